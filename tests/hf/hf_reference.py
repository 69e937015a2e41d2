"""Helpers for the Hugging Face tests: tiny real transformers models, TP sharding exactly as our specs
say, and pure-torch reference forwards of our layouts that simulate TP ranks in one process.

The reference forwards read only *our* translated, per-rank local tensors; they share no code with
transformers, so logits equal to HF's prove the translated weights mean the same thing.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from smpckpt.hf import bert, gpt2, gptj, gptneo, llama, mistral, qwen2, roberta
from smpckpt.model.layout import RankCoords
from smpckpt.model.specs import ShardSpec, SpecRules, shard_geometry
from smpckpt.model.translation import Piece

#: every family, by HF ``config.model_type``; configs, models and forwards of the later five live in
#: ``ref_encoders`` (BERT, RoBERTa) and ``ref_decoders`` (GPT-J, GPT-Neo, Mistral)
MODULES: dict[str, ModuleType] = {
    "gpt2": gpt2,
    "llama": llama,
    "qwen2": qwen2,
    "bert": bert,
    "roberta": roberta,
    "gptj": gptj,
    "gpt_neo": gptneo,
    "mistral": mistral,
}
ENCODERS = ("bert", "roberta")
AUTO_CLASS = {name: "AutoModelForMaskedLM" if name in ENCODERS else "AutoModelForCausalLM" for name in MODULES}


def _family_helpers(name: str) -> ModuleType | None:
    """The helper module holding a later family's config, model and forward (imported lazily: they
    import this module)."""
    if name in ENCODERS:
        import ref_encoders

        return ref_encoders
    if name in ("gptj", "gpt_neo", "mistral"):
        import ref_decoders

        return ref_decoders
    return None


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same keys, and every tensor bit-exact with the same dtype."""
    assert list(a) == list(b) or set(a) == set(b), sorted(set(a) ^ set(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def differing_keys(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys missing from either side or whose tensors differ (bit-exact, dtype included)."""
    return sorted(
        k
        for k in set(a) | set(b)
        if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])
    )


# -- regions and pieces --------------------------------------------------------------------------------


def slices(offsets, sizes) -> tuple[slice, ...]:
    """The index of box ``[offsets, offsets + sizes)``."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def assemble(found: list[Piece], artifact: dict[str, torch.Tensor], sizes) -> torch.Tensor:
    """Fill a region from its pieces, reading only each piece's artifact region; every element exactly once."""
    out = torch.zeros(sizes, dtype=torch.float64)
    count = torch.zeros(sizes, dtype=torch.int64)
    for p in found:
        assert p.dest_sizes == tuple(p.sizes[i] for i in p.perm)
        assert all(o + s <= n for o, s, n in zip(p.offsets, p.sizes, p.view)), p  # inside the artifact tensor
        assert math.prod(p.view) == artifact[p.key].numel()
        assert 0 not in p.sizes
        region = artifact[p.key].reshape(p.view)[slices(p.offsets, p.sizes)].permute(p.perm)
        out[slices(p.dest_offsets, p.dest_sizes)] = region
        count[slices(p.dest_offsets, p.dest_sizes)] += 1
    assert bool((count == 1).all()), "pieces must cover the region exactly once"
    return out


@st.composite
def regions(draw, shape):
    """A random box ``(offsets, sizes)`` inside ``shape``, empty ones included."""
    offsets, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        offsets.append(o)
        sizes.append(draw(st.integers(0, n - o)))
    return tuple(offsets), tuple(sizes)


# -- tiny models and TP shards ------------------------------------------------------------------------


def tiny_config(name: str, **overrides: Any) -> Any:
    """A tiny transformers config (no hub access). GPT-2's vocabulary is odd, like the real 50257, so
    vocab-parallel splits are uneven."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    helpers = _family_helpers(name)
    if helpers is not None:
        return helpers.tiny_config(name, **overrides)

    if name == "gpt2":
        kw: dict[str, Any] = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64)
        return GPT2Config(**{**kw, **overrides})
    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=96,
        max_position_embeddings=64,
    )
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[name](**{**kw, **overrides})


def tiny_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    """A real HF model (:data:`AUTO_CLASS`) from :func:`tiny_config`, randomly initialised under ``seed``,
    in eval mode. Biases and norms are randomised too (HF initialises them to constants, which would hide
    mix-ups)."""
    import transformers

    helpers = _family_helpers(name)
    if helpers is not None:
        return helpers.tiny_model(name, seed=seed, dtype=dtype, **overrides)

    transformers.logging.set_verbosity_error()  # tiny vocabularies trip a bos/eos-id warning
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in pname or "ln_" in pname else 0.0))
    return model.to(dtype).eval()


def global_view(name: str, model: Any) -> dict[str, torch.Tensor]:
    """Our global tensors (view shapes, as the checkpoint stores them) from an HF model."""
    return MODULES[name].translate_hf_state_dict_to_smpckpt(model.state_dict(), keep_view_shapes=True)


def _local_shape(view: tuple[int, ...], spec: ShardSpec) -> tuple[int, ...]:
    """The local tensor a viewed spec describes: our fused layers collapse the first two view dims
    (``[3, d/tp, d]`` -> the local ``nn.Linear``'s ``[3d/tp, d]``)."""
    return view if spec.view is None else (view[0] * view[1], *view[2:])


def shard(key: str, tensor: torch.Tensor, spec: ShardSpec | None, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local tensor of our global (view-shaped) ``tensor`` under ``spec``.

    The global view is split along ``spec.dim`` (evenly, or by ``spec.sizes``) and reshaped to the
    local tensor's shape. ``shard_geometry`` (the planners' own arithmetic) must then place the local
    tensor back at the same offsets in the same global shape, or the spec is wrong.
    """
    if spec is None:
        return tensor.clone()
    sizes = spec.sizes or (tensor.shape[spec.dim] // tp,) * tp
    assert sum(sizes) == tensor.shape[spec.dim], (key, sizes, tensor.shape)
    start = sum(sizes[:rank])
    piece = tensor.narrow(spec.dim, start, sizes[rank])
    local = piece.reshape(_local_shape(tuple(piece.shape), spec)).clone()
    geom = shard_geometry(key, local.shape, (spec,), RankCoords(tp=rank, dp=0, pp=0), {"tp": tp, "dp": 1, "pp": 1})
    assert tuple(geom.global_shape) == tuple(tensor.shape), (key, geom, tensor.shape)
    assert geom.offsets[spec.dim] == start and sum(geom.offsets) == start, (key, geom)
    return local


def shard_all(name: str, ours: dict[str, torch.Tensor], tp: int, config: Any) -> list[dict[str, torch.Tensor]]:
    """Every rank's local state dict, by the module's ``tp_specs``."""
    rules = SpecRules(MODULES[name].tp_specs(tp, config))
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for key, tensor in ours.items():
        matched = rules.match(key)
        spec = None if matched is None else matched[0][0]
        for rank in range(tp):
            out[rank][key] = shard(key, tensor, spec, tp, rank)
    return out


# -- reference forwards (simulated TP: per-rank partial sums are all-reduced by summing) ---------------


def _vocab_embed(ids: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """Vocab-parallel embedding: each rank looks up the ids in its row range, zeros elsewhere; sum."""
    out, start = 0, 0
    for table in tables:
        inside = (ids >= start) & (ids < start + table.shape[0])
        rows = table[(ids - start).clamp(0, table.shape[0] - 1)] * inside.unsqueeze(-1)
        out, start = out + rows, start + table.shape[0]
    assert isinstance(out, torch.Tensor)
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, hd]`` each -> ``[B, T, H*hd]``."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t = q.shape[-2]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], t, -1)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def gpt2_forward(ranks: list[dict[str, torch.Tensor]], config: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits of our TP GPT-2 (``len(ranks)`` ranks) on ``ids`` ``[B, T]``."""
    tp, d, nh, eps = len(ranks), config.n_embd, config.n_head, config.layer_norm_epsilon
    hd, R0 = d // nh, ranks[0]

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (d,), R0[name + ".weight"], R0[name + ".bias"], eps)

    x = _vocab_embed(ids, [r["transformer.wte.weight"] for r in ranks]) + R0["transformer.wpe.weight"][: ids.shape[1]]
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        h = ln(x, p + "ln_1")
        partial = 0
        for L in ranks:
            qkv = h @ L[p + "attn.qkv.weight"].T + L[p + "attn.qkv.bias"]  # [B, T, 3d/tp]: q, k, v of our heads
            q, k, v = (t.unflatten(-1, (nh // tp, hd)).transpose(1, 2) for t in qkv.chunk(3, -1))
            partial = partial + _causal_attention(q, k, v) @ L[p + "attn.proj.weight"].T  # row-parallel
        x = x + partial + R0[p + "attn.proj.bias"]
        h = ln(x, p + "ln_2")
        partial = 0
        for L in ranks:
            partial = (
                partial + _gelu_new(h @ L[p + "mlp.fc.weight"].T + L[p + "mlp.fc.bias"]) @ L[p + "mlp.proj.weight"].T
            )
        x = x + partial + R0[p + "mlp.proj.bias"]
    x = ln(x, "transformer.ln_f")
    return torch.cat([x @ L["transformer.wte.weight"].T for L in ranks], -1)  # tied head, vocab-parallel


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding in HF's rotate-half convention, on ``[B, H, T, hd]``."""
    hd, t = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def head_dim(config: Any) -> int:
    """Llama configs carry ``head_dim``; Qwen2's derive it."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_forward(ranks: list[dict[str, torch.Tensor]], config: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits of our TP Llama / Qwen2 (biases when present) on ``ids``. k/v may be sharded (each rank
    holds ``nkv/tp`` kv heads) or replicated (grouped-query attention with ``nkv < tp``)."""
    nh, eps = config.num_attention_heads, config.rms_norm_eps
    nkv, hd = config.num_key_value_heads, head_dim(config)
    theta = (getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)})[
        "rope_theta"
    ]
    R0 = ranks[0]

    def proj(h: torch.Tensor, L: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        out = h @ L[name + ".weight"].T
        return out + L[name + ".bias"] if name + ".bias" in L else out

    x = _vocab_embed(ids, [r["model.embed_tokens.weight"] for r in ranks])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, R0[p + "input_layernorm.weight"], eps)
        partial = 0
        for rank, L in enumerate(ranks):
            q = proj(h, L, p + "self_attn.q_proj").unflatten(-1, (-1, hd)).transpose(1, 2)
            k = proj(h, L, p + "self_attn.k_proj").unflatten(-1, (-1, hd)).transpose(1, 2)
            v = proj(h, L, p + "self_attn.v_proj").unflatten(-1, (-1, hd)).transpose(1, 2)
            q, k = _rope(q, theta), _rope(k, theta)
            nh_local, nkv_local = q.shape[1], k.shape[1]
            # the kv head each local query head uses: global kv head, minus this rank's first kv head
            # when k/v are sharded (nkv_local < nkv), or as is when every rank holds all of them
            kv_first = rank * nkv_local if nkv_local < nkv else 0
            use = [(rank * nh_local + j) // (nh // nkv) - kv_first for j in range(nh_local)]
            attn = _causal_attention(q, k[:, use], v[:, use])
            partial = partial + attn @ L[p + "self_attn.o_proj.weight"].T
        x = x + partial
        h = _rms(x, R0[p + "post_attention_layernorm.weight"], eps)
        partial = 0
        for L in ranks:
            gate, up = (h @ L[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)  # [gate rows; up rows] of this rank
            partial = partial + (F.silu(gate) * up) @ L[p + "mlp.down_proj.weight"].T
        x = x + partial
    x = _rms(x, R0["model.norm.weight"], eps)
    head = "lm_head.weight" if "lm_head.weight" in R0 else "model.embed_tokens.weight"
    return torch.cat([x @ L[head].T for L in ranks], -1)


FORWARDS = {"gpt2": gpt2_forward, "llama": llama_forward, "qwen2": llama_forward}


def forward_of(name: str) -> Any:
    """The reference TP forward of any family (``ranks, config, ids -> logits``)."""
    helpers = _family_helpers(name)
    return FORWARDS[name] if helpers is None else helpers.FORWARDS[name]


# -- a job reading a full artifact, simulated in one process ------------------------------------------------------


def sim_full_load(root: Any, states: list[dict[str, Any]], translation: Any) -> None:
    """A job of one rank per state dict in ``states`` (a pipeline stage each, ``ParallelLayout(pp=len(states))``)
    reading the full artifact at ``root`` through ``translation`` (its model under ``model.``), partial loads
    allowed (``strict=False``), simulated in one process (each rank's planner and reader, rank 0's global plan:
    tests/sim.py): the tensors of ``states`` loaded in place."""
    from sim import sim_load

    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner
    from smpckpt.storage import FsspecStorageReader

    layout = ParallelLayout(pp=len(states))
    planners = [ParallelLoadPlanner(layout, rank=r, allow_partial_load=True) for r in range(len(states))]
    sim_load(states, planners, [FsspecStorageReader(root, translation=translation, hf_prefix="model.") for _ in states])
