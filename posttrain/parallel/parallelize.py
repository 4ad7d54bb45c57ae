"""Apply tensor parallelism, activation checkpointing, torch.compile and FSDP2, in that order.

The model knows nothing of parallelism (torchtitan's split): this module rewrites it in place.
The order matters: TP turns parameters into DTensors on the `tp` mesh, checkpointing wraps the
blocks, compile traces the wrapped blocks, and FSDP2 shards last so it sees the final modules.

Meta-device flow for large models::

    with torch.device("meta"):
        model = Transformer(hf_config)
    model = parallelize(model, mesh, cfg["memory"], cfg["parallel"])
    materialize(model, info.device, init=False)
    load_full_state_dict(model, hf_tensors_on_rank0, broadcast_from_rank0=True)

Losses: without TP, call `model.lm_head` on the hidden states (chunked CE); the FSDP2 root keeps
its parameters (embeddings, final norm, lm_head) unsharded from its forward until its backward,
so calling the head after the root forward is correct. With TP, the hidden states are a
sequence-sharded DTensor and the head's output stays a vocabulary-sharded DTensor: use
`full_cross_entropy` inside `loss_context(mesh)` (forward and backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from posttrain.models.attention import varlen_available
from posttrain.models.args import ModelArgs, ModelConfigError
from posttrain.models.hf_backend import HFCausalLM
from posttrain.models.lora import LORA_KEYS, LoRALinear, is_nf4, lora_modules
from posttrain.parallel.context_parallel import apply_context_parallel
from posttrain.parallel.distributed import data_parallel_mesh, mesh_size
from posttrain.parallel.expert_parallel import (
    EXPERT_DP_DIM,
    absent_expert_keys,
    apply_expert_parallel,
    expert_layers,
    gather_expert_states,
    uses_expert_parallel,
)

COMPILE_MODES = (None, "blocks", "model")


def _blocks(model: nn.Module) -> nn.ModuleDict | nn.ModuleList:
    """The decoder layers: ours keyed "0".."N-1", a transformers model's in its own module list."""
    return model.blocks() if isinstance(model, HFCausalLM) else model.model.layers


def _refuse_transformers_sharding(model: nn.Module, parallel_cfg: Mapping[str, Any]) -> None:
    """The transformers backend shards with FSDP2 only: its layouts are not in the TP/CP/EP plans."""
    if not isinstance(model, HFCausalLM):
        return
    for key in ("tp", "cp", "ep"):
        if int(parallel_cfg.get(key, 1)) > 1:
            raise ModelConfigError(f"parallel.{key}={parallel_cfg[key]}: the transformers backend "
                                   f"({model.hf_config.get('model_type')}) shards with FSDP2 only; set parallel.{key}=1")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style plan with sequence-parallel norms and a vocabulary-sharded output head.

    Between blocks the residual stream is sharded on the sequence dimension; attention and MLP
    gather it, run column-wise (q/k/v/gate/up) then row-wise (o/down) projections on their local
    heads/columns, and reduce-scatter back. The per-head q/k norms see the local heads as a
    DTensor sharded on the head dimension, so their weight gradients are summed over heads.
    """
    args = model.args
    tp = tp_mesh.size()
    for name, count in (("num_attention_heads", args.num_heads), ("num_key_value_heads", args.num_kv_heads)):
        if count % tp:
            raise ValueError(f"parallel.tp={tp} does not divide the model's {name}={count}")
    if args.vocab_size % tp:
        raise ValueError(f"parallel.tp={tp} does not divide the model's vocab_size={args.vocab_size}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("tensor parallelism does not support LoRA/QLoRA adapters: set parallel.tp=1")
    if args.num_experts:
        raise ValueError("tensor parallelism does not shard mixture-of-experts layers: set parallel.tp=1 "
                         "(FSDP2 shards their experts)")
    layout = unshardable_layout(args)
    if layout:
        raise ModelConfigError(f"parallel.tp={tp}: tensor parallelism does not shard {args.model_type}: {layout}; "
                               "set parallel.tp=1 (FSDP2 shards it)")
    parallelize_module(
        model,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    model.tie_weights()  # both plans shard the tied weight on the vocabulary: one DTensor serves both
    block_plan: dict[str, Any] = {
        "input_layernorm": SequenceParallel(),
        # forward(x, rope, mask, kv_cache): only x changes layout.
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if args.qk_norm:
        # Activations are [B, S, local_heads, head_dim]: dimension 2 is the sharded one.
        block_plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        block_plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    for block in _blocks(model).values():
        parallelize_module(block, tp_mesh, block_plan)


def unshardable_layout(args: ModelArgs) -> str | None:
    """Why the block plan below cannot shard this family's layout (None: it can)."""
    if args.fused_projections:
        return "its fused qkv_proj/gate_up_proj weights would shard as mixed q/k/v (gate/up) rows on each rank"
    if args.qk_norm and not args.qk_norm_per_head:
        return "its q/k RMSNorm spans all heads of the projection, which the plan splits across ranks"
    if args.norm_placement != "pre":
        return "its norms after attention and MLP are not in the plan (pre-norm layouts only)"
    return None


def apply_activation_checkpointing(model: nn.Module, every: int) -> None:
    """Recompute every `every`-th block's activations in backward (non-reentrant); 0 turns it off.

    `checkpoint_wrapper` hides itself from `state_dict()` and the DCP state-dict API, so HF
    names are unchanged.
    """
    if every < 0:
        raise ValueError(f"memory.activation_checkpointing must be >= 0, got {every}")
    if every == 0:
        return
    blocks = _blocks(model)
    for i, (name, block) in enumerate(list(blocks.named_children())):
        if i % every == 0:
            blocks.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_compile(model: nn.Module, mode: str | None) -> None:
    """`torch.compile` each block (shared graph, fast to compile) or the whole model, in place.

    `nn.Module.compile` keeps parameter names (no `_orig_mod.` prefix).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"memory.compile must be one of {COMPILE_MODES}, got {mode!r}")
    if mode is not None:
        torch.compiler.assume_constant_result(varlen_available)
    if mode == "blocks":
        for block in _blocks(model).children():
            block.compile()
    elif mode == "model":
        model.compile()


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mixed_precision: bool,
               expert_mesh: DeviceMesh | None = None) -> None:
    """FSDP2 `fully_shard` on every block, then the root (embeddings, final norm, lm_head).

    `dp_mesh` is 1-D (FSDP) or 2-D (replicate, shard) for HSDP. Mixed precision: bf16
    parameters for compute, float32 gradient reduction and float32 master weights. Under expert
    parallelism each block's held experts are sharded first, over `expert_mesh` (the ranks holding
    the same experts).
    """
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    blocks = list(_blocks(model).children())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keep them gathered.
        reshard = i < len(blocks) - 1
        if expert_mesh is not None:
            for _, experts in expert_layers(block):
                fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    memory_cfg: Mapping[str, Any],
    parallel_cfg: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Apply TP, activation checkpointing, compile and FSDP2 as `memory`/`parallel` config asks.

    With `mesh=None` (one process, no process group) only checkpointing and compile apply.
    Mixed precision needs FSDP2 and a CUDA device; on CPU it is ignored (float32).
    """
    parallel_cfg = parallel_cfg or {}
    _refuse_transformers_sharding(model, parallel_cfg)
    if mesh is None and any(parallel_cfg.get(k, 1) > 1 for k in ("tp", "dp_replicate", "ep", "cp")):
        raise ValueError("parallel.tp / dp_replicate / ep / cp > 1 need a device mesh (launch with torchrun)")
    if mesh_size(mesh, "cp") > 1:
        apply_context_parallel(model, mesh["cp"])
    if mesh is not None and mesh_size(mesh, "tp") > 1:
        apply_tensor_parallel(model, mesh["tp"])
    expert_mesh = None
    if mesh_size(mesh, "ep") > 1:
        apply_expert_parallel(model, mesh["ep"])
        expert_mesh = data_parallel_mesh(mesh, EXPERT_DP_DIM)
    apply_activation_checkpointing(model, int(memory_cfg.get("activation_checkpointing", 0) or 0))
    apply_compile(model, memory_cfg.get("compile"))
    if mesh is not None:
        dp_mesh = data_parallel_mesh(mesh)
        mixed = bool(memory_cfg.get("mixed_precision", False)) and mesh.device_type == "cuda"
        nf4 = _check_nf4_shardable(model, dp_mesh.size() // mesh_size(mesh, "dp_replicate"))
        if dp_mesh.size() > 1:
            apply_fsdp(model, dp_mesh, mixed, expert_mesh)
        elif not nf4 and (mixed or not uses_tensor_parallel(mesh)):
            # One data-parallel rank: FSDP2 still gives mixed precision and the DTensor code path.
            # (torch 2.13's one-rank FSDP2 shortcut cannot gather NF4 weights: QLoRA runs unsharded.)
            apply_fsdp(model, dp_mesh, mixed)
    return model


def _check_nf4_shardable(model: nn.Module, shards: int) -> bool:
    """Whether the model holds NF4 (QLoRA) weights; refuse shard counts NF4's blocks cannot split into.

    FSDP2 splits an NF4 weight by its quantization blocks: a weight of n elements has n / 16384
    scaler groups (blocks of 64, scalers in blocks of 256), which must divide by the shard count.
    """
    found = False
    for name, module in lora_modules(model):
        if not is_nf4(module.weight):
            continue
        found = True
        groups = module.weight.quantization_factor.numel()
        if groups % shards:
            raise ValueError(
                f"QLoRA: {name}.weight has {groups} NF4 scaler groups, not divisible by the "
                f"{shards} FSDP shards; use a shard count dividing {groups} or sft.method=lora"
            )
    return found


def uses_tensor_parallel(mesh: DeviceMesh | None) -> bool:
    return mesh_size(mesh, "tp") > 1


def loss_context(mesh: DeviceMesh | None) -> contextlib.AbstractContextManager:
    """`loss_parallel()` under TP (cross-entropy on vocabulary-sharded logits), else a no-op.

    Wrap both the loss computation and `backward()` in it.
    """
    return loss_parallel() if uses_tensor_parallel(mesh) else contextlib.nullcontext()


def materialize(model: nn.Module, device: torch.device | str, init: bool) -> nn.Module:
    """Allocate a meta-built (possibly sharded) model on `device`; random-init it or only its buffers.

    With `init=False` the parameters are uninitialized memory: load a state dict next. LoRA
    adapters are always initialized (A random, B zero): checkpoints of the base model lack them.
    """
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(buffers_only=not init)
    with torch.no_grad():
        for _, module in lora_modules(model):
            if init:
                nn.init.normal_(module.weight, mean=0.0, std=model.args.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            module.reset_lora_parameters()
    return model


def _with_tied_head(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoints of tied models omit `lm_head.weight`; the module tree has it."""
    if getattr(model.args, "tie_word_embeddings", False) and "lm_head.weight" not in state_dict:
        embed = state_dict.get("model.embed_tokens.weight")
        if embed is not None:
            return {**state_dict, "lm_head.weight": embed}
    return state_dict


def _check_keys(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Every model tensor but the LoRA adapters must come from the checkpoint, and nothing else."""
    expected = {k for k in model.state_dict() if not k.endswith(LORA_KEYS)} | absent_expert_keys(model)
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )


def load_full_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], broadcast_from_rank0: bool = False
) -> None:
    """Load a full (unsharded, HF-named) state dict into a plain or sharded model.

    With `broadcast_from_rank0`, only rank 0 needs real tensors (others pass `{}`): rank 0
    broadcasts and every rank keeps its shard, so the checkpoint is read once per job. LoRA
    adapter tensors may be absent (they keep their initialization); any other mismatch raises.
    """
    if not broadcast_from_rank0 or not dist.is_initialized() or dist.get_rank() == 0:
        state_dict = _with_tied_head(model, state_dict)
        _check_keys(model, state_dict)
    if not dist.is_initialized():
        model.load_state_dict(state_dict, strict=False)
        model.tie_weights()
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=False)
    # set_model_state_dict replaces the dict's entries by the loaded shards: keep the caller's intact.
    set_model_state_dict(model, dict(state_dict), options=options)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict in HF names, on CPU; complete on rank 0 (other ranks get `{}`).

    Every rank must call it (it all-gathers shards). Works on a plain model too.
    """
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {**full, **gather_expert_states(model)} if uses_expert_parallel(model) else full

