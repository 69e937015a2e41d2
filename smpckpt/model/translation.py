"""State-dict translation as lazy region-mapping rules (e.g. Hugging Face <-> our TP layouts).

Two namespaces meet here. *Ours* is our model's global tensor, keyed by our FQN and shaped as the
checkpoint stores it (its global *view* shape: a fused QKV weight is ``[3, d, d]``). The *artifact* is
the foreign file's tensor (an HF safetensors entry), keyed by its own FQN, in its own shape.

Each of our tensors is an :data:`Expr` over artifact tensors (:mod:`smpckpt.model._translation_algebra`,
re-exported here); this module holds the :class:`Rule` s that build them from key templates, the
:class:`Translation` made of them, and :func:`check_translates`, whether one fits the tensors given."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from smpckpt.errors import SpecError
from smpckpt.model._translation_algebra import (
    Cat,
    Expr,
    Leaf,
    Piece,
    Shape,
    evaluate,
    expr_keys,
    expr_shape,
    merge_leading,
    pieces,
    reshaped,
    scatter,
    split_leading,
)

# the algebra's names, then the rules'
__all__ = ["Leaf", "Cat", "Expr", "Piece", "Shape", "expr_shape", "expr_keys", "pieces", "evaluate", "scatter"]
__all__ += ["merge_leading", "split_leading", "reshaped"]
__all__ += ["Rule", "rename", "transpose", "stack", "Translation", "check_translates"]
__all__ += ["ADAPTER_NAMES", "adapter_keys", "refuse_adapters", "check_translation_function"]


# -- rules --------------------------------------------------------------------------------------------

_FIELD = re.compile(r"\{(\w+)\}")


@functools.cache
def _template_regex(template: str) -> re.Pattern[str]:
    """``a.{i}.b`` -> a regex with a named group of digits per field."""
    parts, pos, seen = [], 0, set()
    for m in _FIELD.finditer(template):
        parts.append(re.escape(template[pos : m.start()]))
        name = m.group(1)
        parts.append(f"(?P={name})" if name in seen else rf"(?P<{name}>\d+)")
        seen.add(name)
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("".join(parts))


@dataclasses.dataclass(frozen=True)
class Rule:
    """One of our key templates as an Expr over artifact key templates.

    Templates name numeric fields in braces (``transformer.h.{i}.attn.qkv.weight``); every template of
    a rule uses the same fields, so either side's key determines the other's.

    Args:
        ours: our key template.
        artifact: the artifact key templates the tensor is made of.
        build: ``(artifact keys, their shapes) -> Expr`` of our tensor (used both ways).
        split: ``our shape -> artifact shapes`` (one per template), for saving. Either callable raises
            ValueError for shapes it cannot take.
        fused: ``n`` when ours is ``n`` tensors fused along a new dim 0 that an unsharded model holds
            merged with the next (``[3, d, d]`` stored, ``[3d, d]`` in an ``nn.Linear``): saving then
            also takes our tensor in that merged shape (a TP=1 model saved without specs); ``0``: not."""

    ours: str
    artifact: tuple[str, ...]
    build: Callable[[tuple[str, ...], tuple[Shape, ...]], Expr]
    split: Callable[[Shape], tuple[Shape, ...]]
    fused: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "artifact", tuple(self.artifact))
        if isinstance(self.fused, bool) or not isinstance(self.fused, int) or self.fused < 0:
            raise ValueError(f"rule {self.ours!r}: fused must be a count >= 0, got {self.fused!r}")
        fields = set(_FIELD.findall(self.ours))
        for template in self.artifact:
            if set(_FIELD.findall(template)) != fields:
                raise ValueError(f"rule {self.ours!r}: template {template!r} must use exactly the fields {fields}")

    def match(self, key: str, side: str) -> dict[str, str] | None:
        """Fields of ``key`` if it is one of ours this rule makes (``side`` ``"ours"``) or an artifact key it
        reads (``"artifact"``), else ``None``."""
        templates = (self.ours,) if side == "ours" else self.artifact
        return next((m.groupdict() for t in templates if (m := _template_regex(t).fullmatch(key))), None)


def rename(ours: str, artifact: str) -> Rule:
    """Same tensor, another name."""
    return Rule(ours, (artifact,), build=lambda keys, _shapes: Leaf(keys[0]), split=lambda shape: (shape,))


def _transposed(shape: Shape) -> tuple[Shape]:
    if len(shape) != 2:
        raise ValueError(f"a transpose needs a 2-d tensor, got shape {shape}")
    return ((shape[1], shape[0]),)


def transpose(ours: str, artifact: str) -> Rule:
    """Ours is the transpose of a 2-d artifact tensor (HF GPT-2 ``Conv1D [in, out]`` vs ``Linear [out, in]``)."""
    return Rule(ours, (artifact,), build=lambda keys, _shapes: Leaf(keys[0], perm=(1, 0)), split=_transposed)


def stack(ours: str, artifact: Sequence[str]) -> Rule:
    """Ours is the artifact tensors stacked along a new dim 0 (``[n, *shape]``); they must share a shape.
    A model holding them concatenated (``[n * shape[0], ...]``: a fused ``nn.Linear``) saves too
    (:attr:`Rule.fused`)."""
    templates = tuple(artifact)

    def build(keys: tuple[str, ...], shapes: tuple[Shape, ...]) -> Expr:
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                "stacked tensors must share a shape, got " + ", ".join(f"{k} {s}" for k, s in zip(keys, shapes))
            )
        return Cat(0, tuple(Leaf(k, view=(1, *s)) for k, s in zip(keys, shapes)))

    def split(shape: Shape) -> tuple[Shape, ...]:
        if not shape or shape[0] != len(templates):
            raise ValueError(f"expected a leading dim of {len(templates)} (one per stacked tensor), got {shape}")
        return (shape[1:],) * len(templates)

    return Rule(ours, templates, build=build, split=split, fused=len(templates))


# -- translations -------------------------------------------------------------------------------------


def _shapes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, Shape]:
    out = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key!r}: expected a tensor, got {type(value).__name__}")
        out[key] = tuple(value.shape)
    return out


class Translation:
    """Key and layout translation between our state dict and an artifact's, as lazy rules.

    Built from :class:`Rule` s (first match wins); our keys no rule mentions map to the same artifact
    key unchanged. Optimizer state follows its parameter: ``<param>.<suffix>`` (``x.weight.exp_avg``)
    with the parameter's shape, where the parameter is in the same mapping, gets the parameter's Expr
    with every Leaf key suffixed alike (``hf.weight.exp_avg``); a suffixed key of another shape (scalar
    ``step``) maps to itself. Subclasses may override :meth:`to_artifact` / :meth:`from_artifact`; the
    eager helpers are built on them.

    Args:
        name: for messages (``"gpt2"``).
        rules: the rules.
        ignore: artifact key templates that are not state (non-persistent buffers some exporters
            wrote); :meth:`from_artifact` and the eager import skip them.
        tied: head key -> the key it is tied to (``{"lm_head.weight": "transformer.wte.weight"}``):
            one tensor under two names, neither rewritten by a rule. A file that leaves the head out (as
            ``save_pretrained`` writes) still gives a model holding the head apart its values
            (:meth:`missing_ties`); the eager helpers drop and add heads by it.
        architecture: the transformers class whose state dict the artifact side is
            (``"GPT2LMHeadModel"``), written into ``config.json``'s ``architectures`` when the config
            given has none.
        absent: artifact key templates the artifact's model never holds, whatever its config (Mistral's
            biases): a tensor under one would be written where ``from_pretrained`` ignores it, so
            :func:`check_translates` refuses it on either side."""

    def __init__(
        self,
        name: str,
        rules: Iterable[Rule] = (),
        ignore: Iterable[str] = (),
        tied: Mapping[str, str] | None = None,
        architecture: str | None = None,
        absent: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.ignore: tuple[str, ...] = tuple(ignore)
        self._ignore_re = [_template_regex(t) for t in self.ignore]
        self.absent: tuple[str, ...] = tuple(absent)
        self._absent_re = [_template_regex(t) for t in self.absent]
        self.tied: dict[str, str] = dict(tied or {})
        self.architecture = architecture
        for head, embed in self.tied.items():
            for key in (head, embed):
                if any(r.match(key, side) is not None for r in self.rules for side in ("ours", "artifact")):
                    raise ValueError(f"translation {name!r}: tied key {key!r} is rewritten by a rule")
            if head == embed or head in self.tied.values():
                raise ValueError(f"translation {name!r}: tied head {head!r} must name another tensor than a head")

    def __repr__(self) -> str:
        return f"Translation({self.name!r}, {len(self.rules)} rules)"

    def missing_ties(self, keys: Iterable[str]) -> dict[str, str]:
        """The tied heads ``keys`` lack although their embedding is there: head -> embedding."""
        present = set(keys)
        return {head: embed for head, embed in self.tied.items() if head not in present and embed in present}

    def merged_shapes(self, our_shapes: Mapping[str, Sequence[int]]) -> dict[str, Shape]:
        """Our fused tensors (:attr:`Rule.fused`) of ``our_shapes`` (view shapes, ``[3, d, d]``) -> the
        shape an unsharded model holds them in (``[3d, d]``), optimizer state alike."""
        shapes = {k: tuple(int(s) for s in v) for k, v in our_shapes.items()}
        out: dict[str, Shape] = {}
        for key, shape in shapes.items():
            hit = self._match(key, shapes, "ours")
            fused = self.rules[hit[0]].fused if hit is not None else 0
            if fused and len(shape) >= 2 and shape[0] == fused:
                out[key] = (shape[0] * shape[1], *shape[2:])
        return out

    def is_absent(self, artifact_key: str) -> bool:
        """Whether ``artifact_key`` is one the artifact's model never holds (:attr:`absent`)."""
        return any(r.fullmatch(artifact_key) for r in self._absent_re)

    def is_ignored(self, artifact_key: str) -> bool:
        """Whether ``artifact_key`` is a non-state entry this translation drops on import."""
        return any(r.fullmatch(artifact_key) for r in self._ignore_re)

    def rule_of(self, key: str, shapes: Mapping[str, Sequence[int]], side: str) -> Rule | None:
        """The rule that takes ``key`` of ``shapes`` on ``side`` (``"ours"`` / ``"artifact"``: optimizer
        state by its parameter's), or ``None`` when it keeps its key."""
        found = self._match(key, shapes, side)  # not a copy of every shape per key: quadratic at 8,000 keys
        return None if found is None else self.rules[found[0]]

    def _match(
        self, key: str, shapes: Mapping[str, Sequence[int]], side: str
    ) -> tuple[int, dict[str, str], str] | None:
        """``(rule index, fields, suffix)`` of ``key`` on ``side`` (``"ours"`` / ``"artifact"``): a direct
        match, else the longest ``<param>.<suffix>`` split whose parameter matches and has ``key``'s shape."""
        for candidate, suffix in ((key, ""), *_prefixes(key)):
            got = shapes.get(candidate) if suffix else None
            if suffix and (got is None or tuple(got) != tuple(shapes[key])):
                continue
            for index, rule in enumerate(self.rules):
                fields = rule.match(candidate, side)
                if fields is not None:
                    return index, fields, suffix
        return None

    def to_artifact(self, our_shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, Expr], dict[str, Shape]]:
        """For saving: our key -> Expr over artifact keys, and every artifact key's shape.

        Raises ValueError when a shape does not fit its rule or two of our keys would write one
        artifact key."""
        shapes = {k: tuple(int(s) for s in v) for k, v in our_shapes.items()}
        exprs: dict[str, Expr] = {}
        artifact_shapes: dict[str, Shape] = {}
        owner: dict[str, str] = {}
        for key, shape in shapes.items():
            hit = self._match(key, shapes, "ours")
            if hit is None:
                expr: Expr = Leaf(key)
                produced = {key: shape}
            else:
                expr, produced = self._split(key, shape, *hit)
            for art_key, art_shape in produced.items():
                if art_key in owner:
                    raise ValueError(
                        f"{self.name}: artifact key {art_key!r} would be written from both {owner[art_key]!r} and {key!r}"
                    )
                owner[art_key] = key
                artifact_shapes[art_key] = art_shape
            exprs[key] = expr
        return exprs, artifact_shapes

    def _split(
        self, key: str, shape: Shape, index: int, fields: dict[str, str], suffix: str
    ) -> tuple[Expr, dict[str, Shape]]:
        rule = self.rules[index]
        keys = tuple(t.format(**fields) + suffix for t in rule.artifact)
        try:
            expr, produced = _split_as(rule, keys, shape)
        except ValueError as e:
            merged = rule.fused and len(shape) >= 1 and shape[0] % rule.fused == 0
            try:  # the model's shape of a fused view: [3d, d] for [3, d, d] (a TP=1 model without specs)
                if not merged:
                    raise e
                expr, produced = _split_as(rule, keys, (rule.fused, shape[0] // rule.fused, *shape[1:]))
                expr = merge_leading(expr, produced)
            except ValueError:
                hint = f" (nor, merged, of shape {(rule.fused, shape[0] // rule.fused, *shape[1:])})" if merged else ""
                if rule.fused and not merged:  # a model's shape of the view, [3d, d], that is not one
                    hint = f" (and it does not split into {rule.fused} fused parts on dim 0)"
                raise ValueError(
                    f"{self.name}: our {key!r} of shape {shape} -> {list(keys)}: {e}{hint}. A tensor-parallel "
                    "model's fused tensors are saved in their global view only with the specs the model was "
                    "built with (a ShardSpec view, as smpckpt.hf.<family>.tp_specs gives): pass specs="
                ) from None
        got = expr_shape(expr, produced)
        if got != shape:  # a rule whose split and build disagree is a bug in the rule
            raise ValueError(f"{self.name}: rule {rule.ours!r} rebuilds {key!r} as {got}, not {shape}")
        return expr, produced

    def from_artifact(self, artifact_shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[Expr, Shape]]:
        """For loading: our key -> (Expr, our global shape), covering every artifact key but ignored ones.

        Raises ValueError when a fused tensor's parts are missing or disagree in shape, or two
        translated keys collide."""
        shapes = {k: tuple(int(s) for s in v) for k, v in artifact_shapes.items()}
        groups: dict[tuple[int, tuple[tuple[str, str], ...], str], str] = {}  # -> the artifact key that found it
        for key in shapes:
            hit = None if self.is_ignored(key) else self._match(key, shapes, "artifact")
            if hit is not None:
                groups.setdefault((hit[0], tuple(sorted(hit[1].items())), hit[2]), key)
        made: list[tuple[str, Expr, Shape]] = []  # one per group
        member: dict[str, int] = {}  # artifact key -> index into made
        for (index, items, suffix), seen in groups.items():
            our_key, expr, keys = self._build(shapes, seen, index, dict(items), suffix)
            for k in keys:
                if k in member:
                    raise ValueError(f"{self.name}: {k!r} would be read by two rules")
                member[k] = len(made)
            made.append((our_key, expr, expr_shape(expr, shapes)))
        # our keys in the artifact's order: a fused tensor where its first part was
        out: dict[str, tuple[Expr, Shape]] = {}
        emitted: set[int] = set()
        for key, shape in shapes.items():
            if key in member:
                if member[key] not in emitted:
                    emitted.add(member[key])
                    our_key, expr, our_shape = made[member[key]]
                    _put(out, our_key, (expr, our_shape), self.name)
            elif not self.is_ignored(key):
                _put(out, key, (Leaf(key), shape), self.name)
        return out

    def _build(
        self, shapes: Mapping[str, Shape], seen: str, index: int, fields: dict[str, str], suffix: str
    ) -> tuple[str, Expr, tuple[str, ...]]:
        """``(our key, Expr, artifact keys)`` of one rule instance, checked against ``shapes``."""
        rule = self.rules[index]
        keys = tuple(t.format(**fields) + suffix for t in rule.artifact)
        missing = [k for k in keys if k not in shapes]
        if missing:
            raise ValueError(f"{self.name}: {seen!r} is part of {rule.ours!r} but {missing} is missing")
        for k in keys:  # every part of suffixed state must have its parameter's shape
            base = k[: len(k) - len(suffix)]
            if suffix and shapes.get(base, shapes[k]) != shapes[k]:
                raise ValueError(f"{self.name}: {k!r} has shape {shapes[k]} but {base!r} has {shapes[base]}")
        part_shapes = tuple(shapes[k] for k in keys)
        try:
            expr = rule.build(keys, part_shapes)
            expr_shape(expr, shapes)
        except ValueError as e:
            described = ", ".join(f"{k} {s}" for k, s in zip(keys, part_shapes))
            raise ValueError(f"{self.name}: {described}: {e}") from None
        return rule.ours.format(**fields) + suffix, expr, keys

    def translate_to_artifact(self, ours: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Eager export: our whole tensors -> artifact tensors (may share memory with ``ours``)."""
        exprs, artifact_shapes = self.to_artifact(_shapes_of(ours))
        out: dict[str, torch.Tensor] = {}
        for key, expr in exprs.items():
            out.update(scatter(expr, ours[key], artifact_shapes))
        return out

    def translate_from_artifact(self, artifact: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Eager import: artifact tensors -> our whole tensors (may share memory with ``artifact``)."""
        plan = self.from_artifact(_shapes_of(artifact))
        return {key: evaluate(expr, artifact) for key, (expr, _shape) in plan.items()}


def _split_as(rule: Rule, keys: tuple[str, ...], shape: Shape) -> tuple[Expr, dict[str, Shape]]:
    """``rule``'s Expr of our tensor of ``shape`` over its artifact ``keys``, and their shapes."""
    produced = dict(zip(keys, (tuple(s) for s in rule.split(shape))))
    return rule.build(keys, tuple(produced.values())), produced


def _prefixes(key: str) -> Iterable[tuple[str, str]]:
    """``(param, suffix)`` splits of ``key`` at dots, longest parameter first (``a.b.c`` -> ``a.b``, ``.c``)."""
    pos = len(key)
    while (pos := key.rfind(".", 0, pos)) > 0:
        yield key[:pos], key[pos:]


def _put(out: dict[str, tuple[Expr, Shape]], key: str, value: tuple[Expr, Shape], name: str) -> None:
    if key in out:
        raise ValueError(
            f"{name}: our key {key!r} would be read from both {expr_keys(out[key][0])} and {expr_keys(value[0])}"
        )
    out[key] = value


# -- whether a translation fits ------------------------------------------------------------------------

_SHOW = 5


def _show(keys: Sequence[str]) -> str:
    return ", ".join(repr(k) for k in keys[:_SHOW]) + (f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else "")


def _prefixed(translation: Translation, key: str, side: str) -> tuple[str, str] | None:
    """``(prefix, rule template)`` when a dotted tail of ``key`` is one the rules take whole."""
    pos = 0
    while (pos := key.find(".", pos) + 1) > 0:
        tail = key[pos:]
        for rule in translation.rules:
            if rule.match(tail, side) is not None:
                return key[:pos], rule.ours if side == "ours" else next(iter(rule.artifact))
    return None


def _stranded(
    translation: Translation, kept: Sequence[str], shapes: Mapping[str, Sequence[int]], side: str
) -> dict[str, str]:
    """The ``kept`` (untranslated) keys, each with what follows its module (``bias``), under a module that the rules' templates name on ``side`` only
    (our fused ``mlp.gate_up_proj``; HF's ``mlp.gate_proj`` on import): the other side has no such module,
    so the key would land where nothing reads it (``from_pretrained`` ignores a ``gate_up_proj.bias``).
    Optimizer state beside a parameter in ``shapes`` (a scalar ``<param>.step``) keeps its key by design."""
    ours = {r.ours.rpartition(".")[0] for r in translation.rules}
    theirs = {t.rpartition(".")[0] for r in translation.rules for t in r.artifact}
    only = [
        _template_regex(m).pattern + r"\." for m in sorted((ours - theirs) if side == "ours" else (theirs - ours)) if m
    ]
    modules = [re.compile(p) for p in only]
    out = {}
    for k in kept:
        at = next((hit for m in modules if (hit := m.match(k)) is not None), None)
        if at is not None and not any(param in shapes for param, _ in _prefixes(k)):
            out[k] = k[at.end() :]
    return out


def _refuse_stranded(translation: Translation, stranded: Mapping[str, str], side: str) -> None:
    """Refuse the :func:`_stranded` keys (key -> what follows its module), by what they are: state an adapter
    or a quantiser adds (``lora_A.weight``: merged or stripped first), else a weight or bias the target's
    module cannot hold."""
    target = "the artifact's (Hugging Face) model" if side == "ours" else "our model"
    added = [k for k, rest in stranded.items() if rest not in ("weight", "bias")]  # not a parameter of the module
    if added:
        raise SpecError(
            f"translation {translation.name!r}: {_show(added)} are no weight or bias of their module but state an "
            f"adapter or a quantiser adds to it (LoRA's lora_A/lora_B, scales), under a module {target} does not "
            f"have: merge or strip adapters/quantisation state before {'export' if side == 'ours' else 'import'} "
            "(PEFT's merge_and_unload(), or leave those keys out)"
        )
    if stranded:
        raise SpecError(
            f"translation {translation.name!r} leaves {_show(list(stranded))} as they are, but its rules rewrite the "
            f"other tensors of their module, which {target} does not have: nothing would read them there (a "
            "fused tensor the family's model cannot hold, such as a gate_up_proj.bias for a model without "
            "mlp_bias). Use the translation of the model's family, or leave the tensors out; if the target "
            "does hold them under these names, add a rename rule for each to the translation"
        )


#: the module names PEFT (0.21.2) gives an adapter's state -- every tuner layer's ``adapter_layer_names``
#: (LoRA's ``lora_A``/``lora_B``, DoRA's ``lora_magnitude_vector``, IA3's ``ia3_l``, LoHa's ``hada_*``, LoKr's
#: ``lokr_*``, OFT's ``oft_R``, VeRA's ``vera_lambda_*`` ...) -- and its wrapping of the module adapted
#: (``base_layer``; ``ModulesToSaveWrapper``'s ``original_module`` / ``modules_to_save``). No transformers
#: model names a module so (5.23's ``modeling_*.py``, grepped); a name merely containing one (``flora_A``)
#: is no adapter's. A saved adapter's own file holds these names beside the base weights.
ADAPTER_NAMES = frozenset(
    """adamss_A adamss_B beft_bias boft_R boft_s c3a_kernel deft_P deft_R delora_A delora_B delora_lambda
    fourierft_spectrum frod_lambda_l frod_lambda_s_values glora_A glora_B glora_C glora_D glora_E gralora_A
    gralora_A_general gralora_B gralora_B_general hada_t1 hada_t2 hada_w1_a hada_w1_b hada_w2_a hada_w2_b hira_A
    hira_B hira_embedding_A hira_embedding_B hra_u ia3_l lily_A lily_B lily_router ln_tuning_layers lokr_t2 lokr_w1
    lokr_w1_a lokr_w1_b lokr_w2 lokr_w2_a lokr_w2_b lora_A lora_B lora_E lora_embedding_A lora_embedding_B
    lora_magnitude_vector miss_block oft_R oft_embedding_R osf_svd_params peanut_A peanut_B peanut_decoders
    peanut_encoders poly_lora_A poly_lora_B poly_router psoft_R pvera_lambda_b pvera_lambda_d randlora_gamma
    randlora_lambda road_alpha road_theta shadow_down shadow_dropout shadow_up shadow_update_gate
    shadow_update_transform shira_weight supertuning_lora_A supertuning_lora_B supertuning_values tinylora_v
    trainable_tokens_delta unilora_theta_d vblora_logits_A vblora_logits_B vblora_vector_bank vera_lambda_b
    vera_lambda_d waveft_spectrum base_layer original_module modules_to_save""".split()
)


def adapter_keys(keys: Iterable[str]) -> list[str]:
    """The ``keys`` with a dotted component that is one of :data:`ADAPTER_NAMES` (whole components only)."""
    return [k for k in keys if not ADAPTER_NAMES.isdisjoint(k.split("."))]


def refuse_adapters(keys: Iterable[str], who: str) -> None:
    """Refuse a Hugging Face export holding :func:`adapter_keys` (``who`` begins the message): the model
    ``from_pretrained`` builds has no such modules, so it would drop them without a word, loading the model
    without the adapter (or, for a ``base_layer.weight``, the wrapped module's weight initialised afresh)."""
    found = adapter_keys(keys)
    if found:
        raise SpecError(
            f"{who}{_show(found)} ({len(found)} tensor{'s' if len(found) > 1 else ''}) are state an adapter adds "
            "to its module or PEFT's wrapping of it (LoRA's lora_A/lora_B, IA3's ia3_l, LoKr's lokr_*, "
            "base_layer, ...), which a Hugging Face model does not have: from_pretrained would drop them, loading the "
            "model without the adapter. Merge or strip adapters before export (PEFT's merge_and_unload(), or leave "
            "those keys out)"
        )


def check_translates(
    translation: Translation,
    shapes: Mapping[str, Sequence[int]],
    side: Literal["ours", "artifact"],
    others: Iterable[Translation] = (),
) -> None:
    """Raise :class:`~smpckpt.errors.SpecError` when ``translation`` does not fit the tensors of
    ``shapes`` on ``side`` (``"ours"``: exporting our tensors; ``"artifact"``: importing a Hugging Face
    folder's), naming the keys and what would fit: the three cases of the README's "A translation must
    fit the tensors" (on import, of ``others`` only rules fusing several artifact tensors count: GPT-2's
    renamed ``mlp.c_fc.weight`` is GPT-Neo's own key)."""
    if not translation.rules or not shapes:
        return
    keys = [k for k in shapes if side == "ours" or not translation.is_ignored(k)]
    kept = [k for k in keys if translation.rule_of(k, shapes, side) is None]
    theirs: dict[str, list[str]] = {}  # another translation -> the kept keys it takes
    fused: dict[str, list[str]] = {}  # of those, the ones it fuses from several artifact tensors
    for other in others:
        if other is translation or other.name == translation.name:
            continue
        for key in kept:
            rule = other.rule_of(key, shapes, side)
            if rule is not None:
                theirs.setdefault(other.name, []).append(key)
                if side == "ours" or len(rule.artifact) > 1:
                    fused.setdefault(other.name, []).append(key)
    what = "tensors" if side == "ours" else "Hugging Face tensors"
    if len(kept) == len(keys) and (side == "ours" or theirs):
        prefixed = next((p for k in kept if (p := _prefixed(translation, k, side)) is not None), None)
        if theirs:
            # a family whose rules fuse the tensors names it surest (GPT-2's renames are GPT-Neo's keys);
            # families sharing rules (Llama, Mistral, Qwen2) are named together
            name, found = max((fused or theirs).items(), key=lambda item: len(item[1]))
            names = " or ".join(f"{n}'s" for n, f in (fused or theirs).items() if f == found)
            hint = f"they are {names} ({_show(found)}): use its translation, smpckpt.hf.translation_for({name!r})"
        elif side == "ours" and any(translation.rule_of(k, shapes, "artifact") is not None for k in kept):
            hint = "they already have the artifact's (Hugging Face) names: save without a translation"
        elif prefixed is not None:
            hint = f"some are its {prefixed[1]!r} under the prefix {prefixed[0]!r}: strip the prefix"
        else:
            hint = f"is the model of its family ({translation.architecture or translation.name})?"
        raise SpecError(
            f"translation {translation.name!r} takes none of the {len(keys)} {what} ({_show(kept)}), so it "
            f"would change nothing: {hint}"
        )
    for found in fused.values():
        names = " or ".join(f"{n}'s" for n, f in fused.items() if f == found)
        raise SpecError(
            f"translation {translation.name!r} leaves {_show(found)} as they are, but they are {names} "
            f"{'fused tensors' if side == 'ours' else 'tensors to fuse'}: use the translation of the model's family"
        )
    _refuse_stranded(translation, _stranded(translation, kept, shapes, side), side)
    absent = [k for k in kept if translation.is_absent(k)]
    if absent:
        raise SpecError(
            f"translation {translation.name!r}: {_show(absent)} would be written as they are, but a "
            f"{translation.architecture or translation.name} has no such tensors (from_pretrained would "
            "ignore them): is the model of another family (a Llama with attention_bias or mlp_bias is "
            "smpckpt.hf.llama's)? Otherwise leave them out"
            if side == "ours"
            else f"translation {translation.name!r}: {_show(absent)} are Hugging Face tensors a "
            f"{translation.architecture or translation.name} never holds: load the folder with the translation "
            "of its own family (config.json's model_type)"
        )
    prefixed_keys = [k for k in kept if _prefixed(translation, k, side) is not None]
    if prefixed_keys:
        prefix, template = _prefixed(translation, prefixed_keys[0], side) or ("", "")
        raise SpecError(
            f"translation {translation.name!r} leaves {_show(prefixed_keys)} as they are, but without the prefix "
            f"{prefix!r} they are its {template!r}: save the model without its wrapper (or strip the prefix)"
        )


def check_translation_function(fn: Any, prefix: str = "") -> None:
    """A full checkpoint's ``translate_function``: a :class:`Translation` or ``None``."""
    if fn is not None and not isinstance(fn, Translation):
        raise TypeError(
            f"{prefix}translate_function must be a smpckpt.model.translation.Translation (for example "
            "smpckpt.hf.llama.TRANSLATION): full checkpoints are translated shard by shard (plain callables would "
            f"need the whole state dict on one rank); got {type(fn).__name__}"
        )
