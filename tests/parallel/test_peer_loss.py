"""Naming a lost rank from the collective's error (parallel/peer_loss.py); the real faults, a killed rank and
a host cut off, are in tests/launch/test_multinode.py and test_slurm_multinode.py."""

from __future__ import annotations

from scaletrain.parallel.peer_loss import describe_lost, is_peer_failure
from scaletrain.parallel.placement import RankPlace

PLACES = [RankPlace(rank, rank % 2, f"n{rank // 2 + 1}", "cpu", f"10.77.0.{rank // 2 + 1}") for rank in range(4)]
# gloo's errors as torch 2.13 raises them, seen on the namespace hosts
RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.77.0.2]:18627: "
         "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")
TIMED_OUT = "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.77.0.2]:5266: Connection timed out."
UNNAMED = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation"


def test_a_closed_connection_names_the_host_and_its_ranks():
    assert is_peer_failure(RuntimeError(RESET))
    assert describe_lost(RuntimeError(RESET), PLACES, 10, rank=0) == (
        "lost contact with n2 (10.77.0.2, ranks 2, 3): its connection was closed: a process there exited or was "
        "killed. Stopping (exit 76); a restart resumes from the last checkpoint")


def test_a_silent_host_is_named_with_the_timeout():
    assert is_peer_failure(RuntimeError(TIMED_OUT))
    assert describe_lost(RuntimeError(TIMED_OUT), PLACES, 10, rank=0).startswith(
        "lost contact with n2 (10.77.0.2, ranks 2, 3): no answer within parallel.timeout_s=10 s")


def test_without_a_peer_or_a_store_it_says_what_is_known():
    """No default store in this process: the roll call cannot be taken, and the message says so."""
    assert is_peer_failure(RuntimeError(UNNAMED))
    assert describe_lost(RuntimeError(UNNAMED), PLACES, 10, rank=0).startswith(
        "lost contact with another rank (the backend's error names none, and the rendezvous store did not answer)")


def test_errors_of_this_rank_are_not_a_lost_peer():
    assert not is_peer_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"))
    assert not is_peer_failure(ValueError("timed out"))  # not from a collective backend
