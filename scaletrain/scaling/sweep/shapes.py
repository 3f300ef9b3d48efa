"""Model shapes from target parameter counts (`models.rule` of a sweep spec).

Kaplan et al. 2020 (sec. 3.1, fig. 5) find the loss at fixed N nearly independent of shape over a
wide range of d_model / n_layer, so the plain rule holds one aspect ratio and picks, per target, the
depth whose exact count is nearest. At small N that depth moves in jumps (1 layer here, 2 at the
next size, 5 three sizes on), and neighbouring targets share a shape, which confounds size with depth
in a ladder. With `smooth_depth` the ladder is chosen as a whole: the depth never falls and grows by
at most one layer between neighbouring sizes, the width (hidden size) never falls either, no shape
comes twice, and among such ladders the one nearest the targets and the aspect ratio is taken (a
dynamic programme over the sizes, each with its candidate shapes). Width moves in whole heads of
head_dim, so targets 1.33x apart need a small head_dim (8 at hidden 32-128) to be told apart.
"""

from __future__ import annotations

import dataclasses
import math

from scaletrain.config import Config, ConfigError
from scaletrain.families import model_counts
from scaletrain.model.counts import ModelCounts
from scaletrain.scaling.sweep.spec import ModelShape, ShapeRule

# How much a factor e away from the aspect ratio costs against a factor e away from the target count:
# the count is what the fit reads, while the loss changes by a few percent as d_model / n_layer varies
# over more than an order of magnitude at fixed N (Kaplan et al. 2020, sec. 3.1, fig. 5), so a tenth.
ASPECT_WEIGHT = 0.1


def shape_counts(base: Config, shape: ModelShape) -> ModelCounts:
    return model_counts(with_shape(base, shape))


def with_shape(base: Config, shape: ModelShape) -> Config:
    return dataclasses.replace(base, model=dataclasses.replace(base.model, **dataclasses.asdict(shape)))


def rule_shapes(base: Config, rule: ShapeRule) -> list[ModelShape]:
    """The rule's shape for each of its targets (in the order listed; smooth_depth: ascending)."""
    if rule.smooth_depth:
        return smooth_depth_shapes(base, rule)
    return [_aspect_ratio_shape(base, rule, target) for target in rule.params]


def _aspect_ratio_shape(base: Config, rule: ShapeRule, target: float) -> ModelShape:
    """The shape whose exact count is closest to `target` (in log) at the rule's aspect ratio and head size."""
    best, best_error = None, math.inf
    for num_layers in range(rule.min_layers, rule.max_layers + 1):
        heads = _whole_heads(base, round(rule.aspect_ratio * num_layers / rule.head_dim))
        shape = ModelShape(num_layers=num_layers, hidden_size=heads * rule.head_dim, num_heads=heads)
        error = abs(math.log(max(_count(base, rule, shape), 1) / target))
        if error < best_error:
            best, best_error = shape, error
    return best


def smooth_depth_shapes(base: Config, rule: ShapeRule) -> list[ModelShape]:
    """Per target (ascending) a shape: the depth non-decreasing and +1 at most from one to the next, the
    width non-decreasing, no shape twice; the ladder that minimises the sum over targets of
    ln(count / target)^2 + ASPECT_WEIGHT ln(aspect / aspect_ratio)^2. Each target's candidates are, at
    every depth, the two widths (whole heads of head_dim) whose counts bracket it."""
    targets = sorted(rule.params)
    candidates = [_bracketing_shapes(base, rule, target) for target in targets]
    # per target, per candidate: (cost of the cheapest ladder of the targets so far ending there, index of
    # the previous target's candidate it extends)
    ladders = [[(cost, None) for _, cost in candidates[0]]]
    for index in range(1, len(targets)):
        earlier = [shape for shape, _ in candidates[index - 1]]
        ladders.append([min(((ladders[-1][before][0] + cost, before) for before, previous in enumerate(earlier)
                             if _may_follow(previous, shape)), default=(math.inf, None))
                        for shape, cost in candidates[index]])
    last = min(range(len(ladders[-1])), key=lambda choice: ladders[-1][choice][0])
    if not math.isfinite(ladders[-1][last][0]):
        raise ConfigError(f"models.rule: params={rule.params} have no ladder of distinct shapes of {rule.min_layers} "
                          f"to {rule.max_layers} layers whose depth and width never fall; spread the targets apart "
                          "or widen the layer range")
    chosen = []
    for index in range(len(targets) - 1, -1, -1):
        chosen.append(candidates[index][last][0])
        last = ladders[index][last][1]
    return chosen[::-1]


def _may_follow(earlier: ModelShape, later: ModelShape) -> bool:
    return later != earlier and 0 <= later.num_layers - earlier.num_layers <= 1 \
        and later.hidden_size >= earlier.hidden_size


def _bracketing_shapes(base: Config, rule: ShapeRule, target: float) -> list[tuple[ModelShape, float]]:
    """At each depth, the widest shape counting at most the target and the narrowest counting more (one
    where no shape counts less), each with its cost."""
    shapes = []
    for depth in range(rule.min_layers, rule.max_layers + 1):
        below, heads = None, _whole_heads(base, 1)
        while True:
            shape = ModelShape(num_layers=depth, hidden_size=heads * rule.head_dim, num_heads=heads)
            if _count(base, rule, shape) > target:
                shapes.extend(candidate for candidate in (below, shape) if candidate is not None)
                break
            below, heads = shape, heads + base.parallel.tensor
        if below is None:  # even the narrowest shape at this depth is too large: so is every deeper one
            break
    return [(shape, _cost(base, rule, shape, target)) for shape in shapes]


def _cost(base: Config, rule: ShapeRule, shape: ModelShape, target: float) -> float:
    count_error = math.log(max(_count(base, rule, shape), 1) / target)
    return count_error ** 2 + ASPECT_WEIGHT * math.log(shape.hidden_size / shape.num_layers / rule.aspect_ratio) ** 2


def _whole_heads(base: Config, heads: int) -> int:
    """At least one head, and a multiple of the tensor-parallel size (which splits heads)."""
    tensor = base.parallel.tensor
    return max(tensor, heads + (-heads) % tensor)


def _count(base: Config, rule: ShapeRule, shape: ModelShape) -> int:
    counts = shape_counts(base, shape)
    return counts.non_embedding_params if rule.count == "non_embedding" else counts.total_params
