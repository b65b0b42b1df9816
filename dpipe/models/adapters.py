"""Adapters besides LoRA (`model.adapter`): DoRA, LoKr and LoHa, as peft trains them, and their
files.

Every family writes its adapter through `lora_files.write_lora_files`, which sees the adapter in
the diffusers file's keys (`adapter_kind`): a plain LoRA goes to every format of the family; the
others keep the diffusers file (peft's keys and config, which `load_lora_weights` reads for DoRA
and LoKr) and, for LoKr and LoHa, get a LyCORIS-named file (`lycoris_tensors`). The families'
ComfyUI and kohya maps take LoRA (A, B) pairs, so for the other adapters they are recorded as not
written, with the reason, in exports.json.
"""

from __future__ import annotations

from typing import Any

import torch

from dpipe.config.schema import Adapter

# The first part of every trainable parameter name peft gives an adapter: lora_A / lora_B /
# lora_magnitude_vector (LoRA, DoRA), lokr_w1 / lokr_w1_a ... (LoKr), hada_w1_a ... (LoHa).
ADAPTER_PARTS = ("lora_", "lokr_", "hada_")

LYCORIS_PREFIX = "lycoris_"  # LyCORIS's name for a module of the network it wraps
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
# LyCORIS's Tucker cores of a convolution's adapter (`use_tucker`): the kernel's spatial part kept
# in a (rank, rank, *kernel) core between the two factors (LoCon's lora_mid, LoHa's hada_t1/t2,
# LoKr's lokr_t2). peft's adapters that dpipe trains have none: such files merge, not continue.
TUCKER_CORES = ("lora_mid.weight", "hada_t1", "hada_t2", "lokr_t2")


def is_adapter_param(name: str) -> bool:
    """Whether `name` (a parameter or state-dict key) belongs to a peft adapter of any kind."""
    return any(part.startswith(ADAPTER_PARTS) for part in name.split("."))


def adapter_kind(keys) -> Adapter:
    """The adapter whose weights `keys` name (peft or diffusers names)."""
    keys = list(keys)
    if any(".lokr_" in k for k in keys):
        return Adapter.lokr
    if any(".hada_" in k for k in keys):
        return Adapter.loha
    if any(".lora_magnitude_vector" in k or k.endswith(".dora_scale") for k in keys):
        return Adapter.dora
    return Adapter.lora


def adapter_metadata(cfg, default_targets) -> dict[str, Any]:
    """The keyword arguments of the adapter's peft config class, as diffusers stores them in a
    LoRA file's metadata and reads them back (`LoraConfig(**metadata)`, `LoKrConfig(**...)`)."""
    rank = cfg.lora.rank
    alpha = cfg.lora.alpha if cfg.lora.alpha is not None else rank
    targets = cfg.lora.targets or default_targets
    kind = Adapter(getattr(cfg, "adapter", Adapter.lora))
    if kind in (Adapter.lora, Adapter.dora):
        meta = {"r": rank, "lora_alpha": alpha, "target_modules": targets}
        if kind == Adapter.dora:
            meta["use_dora"] = True
        return meta
    meta = {"r": rank, "alpha": alpha, "target_modules": targets}
    if kind == Adapter.lokr:
        meta["decompose_factor"] = cfg.lokr_factor
    return meta


def peft_config(kind: Adapter, metadata: dict[str, Any], dropout: float = 0.0):
    """peft's config for `kind` from `adapter_metadata`; `dropout` is LoRA's input dropout, and
    for LoKr and LoHa (which have none) their rank dropout."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if kind in (Adapter.lora, Adapter.dora):
        return LoraConfig(**metadata, lora_dropout=dropout, init_lora_weights=True)
    cls = LoKrConfig if kind == Adapter.lokr else LoHaConfig
    return cls(**metadata, rank_dropout=dropout, init_weights=True)


def modules_of(weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {part: tensor}} from diffusers-named adapter weights (`<module>.lokr_w1`,
    `<module>.lora_A.weight`)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights.items():
        parts = key.split(".")
        at = next(i for i, p in enumerate(parts) if p.startswith(ADAPTER_PARTS))
        out.setdefault(".".join(parts[:at]), {})[".".join(parts[at:])] = value
    return out


def lycoris_name(module: str) -> str:
    """LyCORIS's name for a module of the network it wraps."""
    return LYCORIS_PREFIX + module.replace(".", "_")


def lycoris_tensors(weights: dict[str, torch.Tensor], metadata: dict[str, Any],
                    name=lycoris_name) -> dict[str, torch.Tensor]:
    """A LoKr's or LoHa's diffusers-named weights (`<module>.lokr_w1`, no prefix) under the names
    LyCORIS gives a network over the same model: `lycoris_<module, dots as underscores>.lokr_w1`
    (ComfyUI's loader reads these names for FLUX.1's diffusers modules), with `.alpha`.

    The loaders scale by alpha / the rank of a decomposed factor, as peft scales by alpha / r, so
    alpha is written as trained. A LoKr module whose two factors are both full matrices has no
    rank: the loaders then apply scale 1, so peft's alpha / r is folded into `lokr_w2` and no
    alpha is written. `name` gives each module's name in the file (for a format's file, the
    format's name of the module, which ComfyUI reads under `diffusion_model.`)."""
    scale = metadata["alpha"] / metadata["r"]
    out = {}
    for module, parts in sorted(modules_of(weights).items()):
        named = name(module)
        unknown = set(parts) - set(LOKR_PARTS) - set(LOHA_PARTS)
        if unknown:
            raise ValueError(f"{module}: no LyCORIS name for {sorted(unknown)}")
        full_lokr = "lokr_w1" in parts and "lokr_w2" in parts
        for part, value in parts.items():
            if full_lokr and part == "lokr_w2":
                value = value * scale
            out[f"{named}.{part}"] = value.contiguous()
        if not full_lokr:
            out[f"{named}.alpha"] = torch.tensor(float(metadata["alpha"]))
    return out


def lycoris_delta(tensors: dict[str, torch.Tensor], module: str, shape,
                  name: str | None = None) -> torch.Tensor:
    """The weight delta a LyCORIS file's `module` (its diffusers name; or the file's `name` for
    it) adds, as LyCORIS and ComfyUI compute it: for tests, and for merging by hand."""
    name = name or lycoris_name(module)
    t = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
    kind = adapter_kind(f".{part}" for part in t)
    rank = module_rank(kind, t)
    scale = t["alpha"].item() / rank if rank is not None and "alpha" in t else 1.0
    return module_delta(kind, t, scale, shape)


def adapter_shapes(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """{module: the shape of the weight it adapts} from diffusers-named adapter weights."""
    kind = adapter_kind(weights)
    shapes = {}
    for module, t in modules_of(weights).items():
        if kind in (Adapter.lora, Adapter.dora):
            shape = (t["lora_B.weight"].shape[0], t["lora_A.weight"].shape[1])
        elif kind == Adapter.loha:
            shape = (t["hada_w1_a"].shape[0], t["hada_w1_b"].shape[1])
        else:
            w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0],
                                                               t["lokr_w1_b"].shape[1])
            w2 = t["lokr_w2"].shape if "lokr_w2" in t else (t["lokr_w2_a"].shape[0],
                                                               t["lokr_w2_b"].shape[1])
            shape = (w1[0] * w2[0], w1[1] * w2[1])
        shapes[module] = shape
    return shapes


def module_rank(kind: Adapter, parts: dict[str, torch.Tensor]) -> int | None:
    """The rank a module's alpha is divided by, as LyCORIS, kohya and ComfyUI take it: A's rows
    (LoRA), a decomposed factor's (LoKr: the second's where both are; None where neither is)."""
    if kind in (Adapter.lora, Adapter.dora):
        return parts["lora_A.weight"].shape[0]
    if kind == Adapter.loha:
        return parts["hada_w1_b"].shape[0]
    if "lokr_w2_b" in parts:
        return parts["lokr_w2_b"].shape[0]
    if "lokr_w1_b" in parts:
        return parts["lokr_w1_b"].shape[0]
    return None


def module_delta(kind: Adapter, parts: dict[str, torch.Tensor], scale: float,
                 shape) -> torch.Tensor:
    """The fp32 weight delta of one module's adapter `parts` (peft's part names) applied at
    `scale`: scale * B @ A (LoRA), scale * kron(w1, w2) (LoKr), scale * (w1a w1b) * (w2a w2b)
    (LoHa), shaped as the weight. DoRA has none without the base weight (ValueError)."""
    t = {k: v.float() for k, v in parts.items()}
    if kind == Adapter.dora:
        raise ValueError("a DoRA's delta depends on the base weight: merge it through peft")
    if kind == Adapter.lora and "lora_mid.weight" in t:
        delta = tucker(t["lora_mid.weight"], t["lora_B.weight"].flatten(1).T,
                       t["lora_A.weight"].flatten(1))
    elif kind == Adapter.lora:
        delta = t["lora_B.weight"].flatten(1) @ t["lora_A.weight"].flatten(1)
    elif kind == Adapter.loha and "hada_t1" in t:
        delta = (tucker(t["hada_t1"], t["hada_w1_a"], t["hada_w1_b"])
                 * tucker(t["hada_t2"], t["hada_w2_a"], t["hada_w2_b"]))
    elif kind == Adapter.loha:
        delta = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
    else:
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        w2 = (t["lokr_w2"] if "lokr_w2" in t
              else tucker(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"]) if "lokr_t2" in t
              else t["lokr_w2_a"] @ t["lokr_w2_b"])
        # A convolution's w2 keeps its kernel dims: w1 gets them as 1s, so the Kronecker
        # product multiplies the channels only (LyCORIS's make_kron).
        delta = torch.kron(w1.reshape(*w1.shape, *[1] * (w2.dim() - w1.dim())), w2.contiguous())
    return (delta * scale).reshape(shape)


def tucker(core: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A Tucker-factored kernel: delta[o, i, k...] = sum over a, b of core[a, b, k...] *
    up[a, o] * down[b, i] (`up` (rank, out), `down` (rank, in): LyCORIS's rebuild_tucker)."""
    return torch.einsum("ab...,ao,bi->oi...", core, up, down)


def load_adapter_file(model: torch.nn.Module, file, prefix: str = "transformer",
                      adapter_name: str = "default") -> None:
    """Puts a diffusers-format adapter file of dpipe's (peft's keys under `<prefix>.`, peft's
    config in its metadata) on `model` through peft: the way to load a LoHa, which diffusers has
    no loader for (any other adapter loads this way too). A LoRA file without the config gets
    each module's rank from its shapes and scale 1, as diffusers reads such a file. Raises
    ValueError naming the keys the model has no place for."""
    import json

    from safetensors import safe_open

    lead = f"{prefix}." if prefix else ""
    with safe_open(str(file), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
        tensors = {k.removeprefix(lead): f.get_tensor(k) for k in f.keys() if k.startswith(lead)}
    meta = {k.removeprefix(lead): v for k, v in meta.items() if k.startswith(lead)}
    kind = adapter_kind(tensors)
    if not meta and kind != Adapter.lora:
        raise ValueError(f"{file}: a {kind.value} file without its adapter config "
                         "(lora_adapter_metadata)")
    load_adapter_tensors(model, tensors, kind, meta or None, adapter_name)


def load_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], kind: Adapter,
                         meta: dict[str, Any] | None = None, adapter_name: str = "default"
                         ) -> None:
    """Puts diffusers-named adapter `tensors` on `model` through peft, with peft's config `meta`
    or, without it, each module's rank from its shapes and scale 1 (LoRA and DoRA). Raises
    ValueError naming the keys the model has no place for."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    if meta is None:
        meta = lora_config_from_shapes(tensors)
        if kind == Adapter.dora:
            meta["use_dora"] = True
    inject_adapter_in_model(peft_config(kind, meta), model, adapter_name=adapter_name)
    result = set_peft_model_state_dict(model, tensors, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise ValueError(f"the model has no place for {result.unexpected_keys[:5]}")


def lora_config_from_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """LoraConfig arguments for a LoRA file without its config: each module's rank from its A,
    alpha = rank (scale 1)."""
    from collections import Counter

    ranks = {m: parts["lora_A.weight"].shape[0] for m, parts in modules_of(tensors).items()}
    r = Counter(ranks.values()).most_common(1)[0][0]
    other = {m: v for m, v in ranks.items() if v != r}
    return {"r": r, "lora_alpha": r, "target_modules": sorted(ranks),
            "rank_pattern": other, "alpha_pattern": dict(other)}
