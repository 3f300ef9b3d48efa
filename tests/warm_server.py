"""`python tests/warm_server.py SOCKET`: tests/warm.py's WarmServer, as warm_socket() starts it.

Started by path, not as `python -m tests.warm`, so that no frame of the frozen runpy module sits at the
bottom of every fork's stack. inspect.getmodule() scans every loaded module (about 5,000 in a fork) for
each frame whose file is no module's, such as `<frozen runpy>`, and torchrun's rendezvous calls
inspect.stack() twice for each event it records (get_method_name in
torch/distributed/elastic/rendezvous/dynamic_rendezvous.py): 45 ms a call with the two runpy frames, 2.6 ms
without. A TP2 x PP2 layout test (three torchrun launches) used 1.6 s less CPU of its 37 s (mean of three runs).
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # not where multiprocessing's spawn re-imports a fork's main module as __mp_main__
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, as `python -m` from it would have
    from tests.warm import main

    main(sys.argv[1])
