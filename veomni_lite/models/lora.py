"""LoRA: a frozen transformers model with small trained adapters, sharded by FSDP2 and saved in PEFT's format.

`model.lora: {rank, alpha, dropout, target_modules}` (`LoraSettings.parse`; `{}`, the default, trains every weight).
`apply_lora(model, settings, seed)` freezes every parameter of the wrapper (`requires_grad` False: no gradient, no
optimizer state) and replaces each targeted `nn.Linear` of its transformers model by a `LoraLinear`, which keeps the
same `weight` and `bias` Parameters (so the base's state-dict names, which sharded loading, checkpoints and export
read, do not change) and adds the trained `lora_A` [rank, in] and `lora_B` [out, rank]:
`y = W x + b + (alpha / rank) B A dropout(x)`, PEFT's forward (x cast to the adapters' dtype, the sum cast back to
the base's). Adapters are float32 (float64 on a float64 base), whatever the base's dtype. It works on the meta device.

`init_adapters(model, seed)`: A kaiming-uniform (PEFT's init: bound 1/sqrt(in)) from one generator seeded by `seed`
in module order, B zero, so every rank and every layout gets the same values; each rank writes its own shards (after
`fully_shard` and `to_empty` on the meta-device path).

Targets: an entry of `target_modules` matches a Linear whose path inside the transformers model it equals or ends
(after a dot), `*` globbing (PEFT's rule, plus globs); `all-linear` is every Linear but the output head. A
vision-language family's tower (`Vision.tower` in the registry) is left out unless an entry names it (has the tower's
name as a component: `visual.*.qkv`). An entry that matches no Linear layer is a `LoraError` naming
`model.lora.target_modules` (`check_directory` runs the match on the directory's model built on the meta device,
before any process group starts).

A mixture of experts (transformers 5): its routed experts are fused 3-D parameters (`experts.gate_up_proj` [E, 2I,
H], `experts.down_proj`), not Linear layers, and its router (`mlp.gate`) is a module of its own: LoRA adapts neither,
they stay frozen, and an entry naming them is a `LoraError` saying so; `all-linear` adapts the attention, the shared
experts' MLPs and the dense layers' (and, where the router is a Linear, e.g. Qwen2-MoE's `shared_expert_gate`, it).

Modules that train whole (PEFT's `modules_to_save`): a wrapper's `lora_modules_to_save`, paths inside its
transformers model (`whole_modules`): a reward model's new score head (`HFRewardModel`: `score`), which the base
directory does not hold, so freezing it would leave the reward untrainable. They keep `requires_grad`, no adapter is
put on them (`all-linear` leaves them out; an entry naming one is a `LoraError`), and they are saved with the
adapters (checkpoints keep the parameters that train; `adapter_state` writes them under PEFT's names).

PEFT's format: `adapter_state(model)` gives `adapter_model.safetensors`' tensors (`base_model.model.<path>.lora_A
.weight`, a whole-trained module's `base_model.model.<path>.weight`), `peft_config(...)` its `adapter_config.json`
(`task_type` the wrapper's `peft_task_type`: CAUSAL_LM, or SEQ_CLS for a reward model, with its `modules_to_save`);
`peft_targets` re-resolves the saved `target_modules` as PEFT does. `merge_lora(model)` folds W + (alpha / rank) B A
into the base weights and puts plain Linears back.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from veomni_lite.models.pretrained import hf_child, load_config
from veomni_lite.models.registry import family_of

ALL_LINEAR = "all-linear"
ADAPTERS = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY = "model.lora"


class LoraError(ValueError):
    """A `model.lora` setting that cannot be used (the message names the key)."""


@dataclass(frozen=True)
class LoraSettings:
    """`model.lora`, checked: `rank` >= 1, `alpha` > 0 (default: the rank, a scaling of 1), `dropout` in [0, 1)
    (default 0), `target_modules` a non-empty list of entries (default `[all-linear]`)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> LoraSettings | None:
        """None when LoRA is off: `{}` or `{rank: 0}`; else the settings, or a LoraError naming the key."""
        known = {"rank", "alpha", "dropout", "target_modules"}
        if unknown := sorted(set(settings) - known):
            raise LoraError(f"{KEY}: unknown key(s) {unknown}; {KEY} has {sorted(known)}")
        rank = settings.get("rank", 0)
        if not settings or (set(settings) == {"rank"} and rank == 0):
            return None
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise LoraError(
                f"{KEY}.rank: LoRA needs a rank >= 1, got {rank!r} (with {KEY} {dict(settings)}); "
                f"{KEY}: {{}} trains every weight instead"
            )
        alpha = settings.get("alpha", rank)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise LoraError(f"{KEY}.alpha: must be a number > 0, got {alpha!r}")
        dropout = settings.get("dropout", 0.0)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise LoraError(f"{KEY}.dropout: must be in [0, 1), got {dropout!r}")
        targets = settings.get("target_modules", [ALL_LINEAR])
        targets = [targets] if isinstance(targets, str) else targets
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise LoraError(
                f"{KEY}.target_modules: expected module names (e.g. [q_proj, v_proj]) or {ALL_LINEAR!r}, "
                f"got {settings.get('target_modules')!r}"
            )
        return cls(rank, float(alpha), float(dropout), tuple(targets))


class LoraLinear(nn.Linear):
    """An `nn.Linear` with a LoRA adapter (see the module docstring); `weight` and `bias` are the base's own."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        dtype, device = torch.promote_types(base.weight.dtype, torch.float32), base.weight.device
        options = {"bias": False, "device": device, "dtype": dtype}
        self.lora_A = nn.utils.skip_init(nn.Linear, self.in_features, rank, **options)  # no global RNG drawn
        self.lora_B = nn.utils.skip_init(nn.Linear, rank, self.out_features, **options)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = nn.functional.linear(x, self.weight, self.bias)
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return (result + update * self.scaling).to(result.dtype)


def _plain_linear(module: nn.Linear) -> nn.Linear:
    """A plain `nn.Linear` holding `module`'s own weight and bias Parameters."""
    plain = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(plain)
    plain.in_features, plain.out_features = module.in_features, module.out_features
    plain.weight = module.weight
    plain.register_parameter("bias", module.bias)
    return plain


def _tower_path(hf_model: nn.Module) -> str | None:
    vision = family_of(hf_model.config).vision
    return vision.tower if vision is not None else None


def _matches(path: str, entry: str) -> bool:
    return fnmatch.fnmatchcase(path, entry) or fnmatch.fnmatchcase(path, f"*.{entry}")


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(f"{root}.") for root in roots)


def whole_modules(model: nn.Module) -> tuple[str, ...]:
    """The paths (inside the transformers model) of the modules that train whole under LoRA (module docstring)."""
    return tuple(getattr(model, "lora_modules_to_save", ()))


def resolve_targets(hf_model: nn.Module, entries: tuple[str, ...], whole: tuple[str, ...] = ()) -> list[str]:
    """The paths (inside `hf_model`) of the Linear layers `entries` target (see the module docstring), in module
    order, none inside the `whole` modules; a LoraError naming `model.lora.target_modules` for an entry that matches
    none, or only a module that trains whole."""
    tower = _tower_path(hf_model)
    tower_name = tower.rsplit(".", 1)[-1] if tower else None
    output = hf_model.get_output_embeddings()
    modules = [(path, module) for path, module in hf_model.named_modules() if path]
    linears = [(p, m) for p, m in modules if isinstance(m, nn.Linear) and not isinstance(m, LoraLinear)]
    kept = [(p, m) for p, m in linears if not _inside(p, whole)]
    chosen: set[str] = set()
    for entry in entries:
        names_tower = tower_name is not None and tower_name in entry.split(".")

        def allowed(path: str, entry_names_tower: bool = names_tower) -> bool:
            in_tower = tower is not None and (path == tower or path.startswith(f"{tower}."))
            return entry_names_tower or not in_tower

        if entry == ALL_LINEAR:
            found = {p for p, m in kept if m is not output and allowed(p, False)}
        else:
            found = {p for p, _ in kept if _matches(p, entry) and allowed(p)}
        if not found and (named := sorted(p for p, _ in linears if _matches(p, entry) and _inside(p, whole))):
            raise LoraError(
                f"{KEY}.target_modules: {entry!r} names {named}, which train whole under LoRA (a new head of "
                f"{type(hf_model).__name__}, as PEFT's modules_to_save), not through adapters; name other layers"
            )
        if not found:
            raise LoraError(_no_match(hf_model, entry, modules, kept, tower, allowed))
        chosen |= found
    return [path for path, _ in linears if path in chosen]


def _no_match(hf_model: nn.Module, entry: str, modules: list, linears: list, tower: str | None, allowed: Any) -> str:
    what = type(hf_model).__name__
    if entry == ALL_LINEAR:
        return f"{KEY}.target_modules: {ALL_LINEAR!r}: {what} has no Linear layer (outside its output head) to adapt"
    matched = [m for p, m in modules if _matches(p, entry) and allowed(p)]
    others = sorted({type(m).__name__ for m in matched})
    names = sorted({p.rsplit(".", 1)[-1] for p, _ in linears if allowed(p)})
    found = f"it names {others}, not Linear layers; " if others else ""
    fused = any(param.dim() == 3 for path, param in hf_model.named_parameters() if _matches(path, entry))
    if fused or any(hasattr(m, "num_experts") or hasattr(m, "top_k") for m in matched):
        found += "a mixture of experts' routed experts (fused 3-D parameters) and router stay frozen under LoRA; "
    hint = f"; the vision tower ({tower}) only through an entry naming it, e.g. 'visual.*.qkv'" if tower else ""
    layers = f"{found}its Linear layers: {names}{hint}"
    return f"{KEY}.target_modules: {entry!r} matches no Linear layer of {what} ({layers})"


def apply_lora(model: nn.Module, settings: LoraSettings, seed: int) -> list[str]:
    """Freeze `model` but its `whole_modules` and put adapters on its targets (module docstring); returns their paths
    inside the transformers model. Off the meta device the adapters are initialized here (`init_adapters`)."""
    _, hf_model = hf_child(model)
    whole = whole_modules(model)
    targets = resolve_targets(hf_model, settings.target_modules, whole)
    model.requires_grad_(False)
    for path in whole:
        hf_model.get_submodule(path).requires_grad_(True)
    for path in targets:
        parent_path, _, name = path.rpartition(".")
        parent = hf_model.get_submodule(parent_path)
        setattr(parent, name, LoraLinear(getattr(parent, name), settings.rank, settings.alpha, settings.dropout))
    if not any(param.is_meta for param in model.parameters()):
        init_adapters(model, seed)
    return targets


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    """(path inside the transformers model, module) of every adapted layer, in module order."""
    _, hf_model = hf_child(model)
    return [(path, module) for path, module in hf_model.named_modules() if isinstance(module, LoraLinear)]


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict name is an adapter's (not a base weight, which a model directory holds)."""
    return any(f".{adapter}." in f".{name}" for adapter in ADAPTERS)


@torch.no_grad()
def _write(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param` (a plain tensor, or this rank's shard of a DTensor) set to `value`, the whole tensor."""
    if isinstance(param, DTensor):
        value = value.to(param.device, param.dtype)
        value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def init_adapters(model: nn.Module, seed: int) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a = sqrt(5), as PEFT) from a generator seeded by `seed`,
    drawn whole in module order on every rank; B = 0. No collective."""
    generator = torch.Generator().manual_seed(seed)
    for _, module in lora_modules(model):
        a, b = module.lora_A.weight, module.lora_B.weight
        bound = 1 / math.sqrt(module.in_features)
        _write(a, torch.empty(a.shape, dtype=torch.float64).uniform_(-bound, bound, generator=generator).to(a.dtype))
        _write(b, torch.zeros(b.shape, dtype=b.dtype))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def adapter_state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (`base_model.model.<path>.lora_A.weight`) and the modules that train whole
    (`base_model.model.<path>.<name>`, PEFT's names for `modules_to_save`), whole, contiguous, on the CPU."""
    _, hf_model = hf_child(model)
    tensors = {}
    for path, module in lora_modules(model):
        for adapter in ADAPTERS:
            tensors[f"{path}.{adapter}.weight"] = getattr(module, adapter).weight
    for path in whole_modules(model):
        for name, param in hf_model.get_submodule(path).named_parameters():
            tensors[f"{path}.{name}"] = param
    state = {}
    for name, tensor in tensors.items():
        value = _full(tensor).cpu()
        state[f"{PEFT_PREFIX}{name}"] = value.to(dtype or value.dtype).contiguous()
    return state


def _peft_matches(path: str, names: list[str]) -> bool:
    return any(path == name or path.endswith(f".{name}") for name in names)


def peft_targets(hf_model: nn.Module, names: list[str], whole: tuple[str, ...] = ()) -> list[str]:
    """The Linear layers PEFT adapts for an adapter_config.json's `target_modules` list (never inside one of its
    `modules_to_save`, `whole`)."""
    return [
        p
        for p, m in hf_model.named_modules()
        if isinstance(m, nn.Linear) and _peft_matches(p, names) and not _inside(p, whole)
    ]


def peft_config(
    settings: LoraSettings,
    hf_model: nn.Module,
    targets: list[str],
    base: str | Path,
    task_type: str = "CAUSAL_LM",
    whole: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`adapter_config.json` of these adapters on the model of the directory `base` (PEFT's `task_type`; `whole`: the
    modules that train whole, its `modules_to_save`). `target_modules` is the layers' short names where PEFT's own
    rule resolves them to exactly `targets` (it has no notion of a vision tower or an output head), else their full
    paths."""
    short = sorted({path.rsplit(".", 1)[-1] for path in targets})
    every = [path for path, _ in hf_model.named_modules() if path and not _inside(path, whole)]
    names = short if {p for p in every if _peft_matches(p, short)} == set(targets) else list(targets)
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": str(Path(base).resolve()),
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": names,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": list(whole) or None,
    }


def write_adapter_config(
    model: nn.Module, settings: LoraSettings | None, base: str | Path, directory: str | Path
) -> None:
    """`directory/adapter_config.json` for the adapters on `model` (what `veomni_lite.export` writes out); without
    `settings` (no LoRA) an earlier run's file there is removed, so the export does not take the run for a LoRA run."""
    path = Path(directory) / ADAPTER_CONFIG
    if settings is None:
        path.unlink(missing_ok=True)
        return
    task_type = getattr(model, "peft_task_type", "CAUSAL_LM")
    targets = [p for p, _ in lora_modules(model)]
    config = peft_config(settings, hf_child(model)[1], targets, base, task_type, whole_modules(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(directory: str | Path) -> dict[str, Any] | None:
    """`directory/adapter_config.json`, or None where there is none (not a LoRA run)."""
    path = Path(directory) / ADAPTER_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def settings_of_peft_config(config: Mapping[str, Any]) -> LoraSettings:
    return LoraSettings(int(config["r"]), float(config["lora_alpha"]), float(config["lora_dropout"]), ())


def apply_peft_config(model: nn.Module, config: Mapping[str, Any]) -> list[str]:
    """Adapters (freshly initialized) on the layers an `adapter_config.json` names, as PEFT would place them."""
    _, hf_model = hf_child(model)
    targets = peft_targets(hf_model, list(config["target_modules"]), whole_modules(model))
    settings = settings_of_peft_config(config)
    return apply_lora(model, LoraSettings(settings.rank, settings.alpha, settings.dropout, tuple(targets)), seed=0)


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """W <- W + (alpha / rank) B A in every adapted layer (in float32 at least), then the plain Linear put back."""
    _, hf_model = hf_child(model)
    for path, module in lora_modules(model):
        weight = module.weight
        delta = (module.lora_B.weight @ module.lora_A.weight) * module.scaling
        weight.copy_((weight.to(delta.dtype) + delta).to(weight.dtype))
        parent_path, _, name = path.rpartition(".")
        setattr(hf_model.get_submodule(parent_path), name, _plain_linear(module))


def check_directory(directory: str | Path, settings: LoraSettings) -> list[str]:
    """The targets of `settings` on the model of `directory`, built on the meta device (nothing allocated, nothing
    read but its config); a LoraError naming the key where an entry matches nothing."""
    config = load_config(directory)
    with torch.device("meta"):
        model = family_of(config).build(config)
    return resolve_targets(hf_child(model)[1], settings.target_modules)
