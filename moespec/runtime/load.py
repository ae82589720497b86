"""load_offloaded: a checkpoint folder loaded as an OffloadedModel (runtime/model.py).

Loading builds the model skeleton with empty (meta) weights, swaps every sparse MoE block of
this instance for an OffloadedMoeBlock, then reads the checkpoint tensor by tensor: expert
tensors go into the packed host store, everything else (embeddings, attention, norms, routers,
shared experts, lm_head) onto the device. Peak host memory is about the loaded size (store + dense
part): the checkpoint is read through a bounded window of its file mapping (checkpoint.iter_tensors).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from moespec.artifacts import model_key
from moespec.config import CachePolicy, OnMiss, Predictor, RuntimeConfig, format_binary
from moespec.errors import BudgetError, CalibrationError, CheckpointError, DeviceError, OptionError
from moespec.kernels import native
from moespec.models import adapter_for
from moespec.models.base import MoeAdapter
from moespec.predict.base import LayerRef, NoPredictor
from moespec.predict.factory import make_predictor
from moespec.runtime import disk_tier
from moespec.runtime.cache.eviction import load_seed, make_rule, resolve_policy
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.host.disk_store import DiskStore, round_up
from moespec.runtime.host.heap_trim import release_free_heap
from moespec.runtime.compile import apply_compile
from moespec.runtime.decode_layer import install_decode_layers
from moespec.runtime.decode_model import install_model_step
from moespec.runtime.router_call import install_routers
from moespec.runtime.dense import install_dense, resolve_dense_dtype
from moespec.runtime.norm_call import install_norms
from moespec.runtime.host.memory import check_host_memory
from moespec.runtime.host.quant_store import QuantStoreCache
from moespec.runtime.host.source import CheckpointSource, SafetensorsSource
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.layer.policy import LayerPolicy
from moespec.runtime.layer.runner import MoeLayerRunner
from moespec.runtime.model import OffloadedModel, OffloadedMoeBlock, wire_recorder
from moespec.runtime.stats import NullRecorder, StatsRecorder
from moespec.runtime.transfer.base import TransferEngine
from moespec.runtime.transfer.cuda import CudaTransferEngine
from moespec.runtime.transfer.thread import ThreadTransferEngine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available, else cpu; a CUDA device always comes back with its index.

    Raises:
        DeviceError: cuda requested on a machine without CUDA, or an index beyond the devices.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise DeviceError(f"--device {name!r} is not a device", "use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {name} was requested but this machine has no CUDA device",
                          "use --device cpu (optionally with --link-gbps to emulate a PCIe link)")
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {name} is not supported", "use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        # An explicit index from here on: every stream, event, pin and synchronize names it, so
        # nothing touches cuda:0 when cuda:1 is asked for.
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= count:
            raise DeviceError(f"--device {name} does not exist: this machine has {count} CUDA device(s)",
                              f"use cuda:0 ... cuda:{count - 1}")
        dev = torch.device("cuda", index)
    return dev


def resolve_dtype(name: str, config) -> torch.dtype:
    """"auto" -> the checkpoint's dtype (float32 when it names none).

    Raises:
        OptionError: an unknown dtype name.
    """
    if name == "auto":
        dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dt, str):
            dt = _DTYPES.get(dt, torch.float32)
        return dt if isinstance(dt, torch.dtype) else torch.float32
    if name not in _DTYPES:
        raise OptionError(f"--dtype {name!r} is not supported", f"use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def min_slots(top_k: int, predictor: Predictor) -> int:
    """Fewest cache slots that work: K for the running layer (+ K prefetch slots when predicting)."""
    return top_k * (1 if predictor == Predictor.NONE else 2)


def num_slots(cfg: RuntimeConfig, top_k: int, total_experts: int, expert_bytes: int) -> int:
    """Slots from --cache-experts or --gpu-memory (default: every expert fits).

    Raises:
        BudgetError: below the minimum (0 and negative included); states the minimum in experts and
            in MiB/GiB, and the hint names a value of each flag that works.
    """
    need = min_slots(top_k, cfg.predictor)
    per = format_binary(expert_bytes)
    if cfg.cache_experts is not None:
        slots, asked = cfg.cache_experts, f"--cache-experts {cfg.cache_experts}"
    elif cfg.gpu_memory_bytes is not None:
        slots = cfg.gpu_memory_bytes // expert_bytes
        asked = f"--gpu-memory {format_binary(cfg.gpu_memory_bytes)} (room for {slots} experts of {per})"
    else:
        return total_experts
    if slots < need:
        why = f"{top_k} for the running layer" + ("" if cfg.predictor == Predictor.NONE else f" + {top_k} prefetch slots")
        alt = "" if cfg.predictor == Predictor.NONE else f", or --predictor none (minimum {top_k})"
        raise BudgetError(f"{asked} is below the minimum of {need} experts = {format_binary(need * expert_bytes)} "
                          f"({why}; {per} per expert)",
                          f"use --cache-experts {need} or --gpu-memory {format_binary(need * expert_bytes, True)} "
                          f"or more{alt}")
    return min(slots, total_experts)


def make_transfer_engine(device: torch.device, num_slots: int, link_gbps: float | None) -> TransferEngine:
    """CUDA demand + prefetch streams on a CUDA device, else the (optionally throttled) worker thread."""
    if device.type == "cuda":
        return CudaTransferEngine(device, num_slots)
    return ThreadTransferEngine(link_gbps)


def host_bytes_needed(model: nn.Module, store_bytes: int, device: torch.device) -> int:
    """Host RAM the loaded model holds: the expert store, plus the dense weights when they stay on the CPU.

    ``model`` is the empty-weights skeleton (its expert parameters are not counted: they go to the store).
    """
    if device.type != "cpu":
        return store_bytes
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    return store_bytes + dense


def _moe_layers(model: nn.Module, adapter: MoeAdapter) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if adapter.is_moe_block(layer.mlp)]


def _rule_factory(cfg: RuntimeConfig, policy, path: Path, top_k: int, slots: int, config, refs: list[LayerRef]):
    """What makes the cache's eviction rule for ``policy`` (resolve_policy's; seeded ones read the calibration file),
    and a note for the user or None. Called once the routers are loaded: a seeded policy's file must be
    this model's (as the quasi predictor's must). A stale file is an error when the policy was asked
    for; for the default policy the cache falls back to LRU with a one-line note.

    Raises:
        CalibrationError: a seeded policy asked for without a calibration file, or with another model's.
    """
    seed, note = None, None
    if policy.needs_calibration:
        try:
            seed = load_seed(path, cfg.calibration_path, top_k, config, [r.layer for r in refs],
                             [r.block.gate.weight for r in refs])
        except CalibrationError as exc:
            if cfg.cache_policy is not None:
                raise
            key = model_key(path)  # the error says why (another model's, truncated, corrupt): not guessed here
            note = f"{exc.message}; cache policy lru, not {policy.value} (run `moespec calibrate {key}`)"
            policy = CachePolicy.LRU
    return partial(make_rule, policy, seed, slots, top_k), note


def open_source(folder: str | Path) -> CheckpointSource:
    """The source of the model folder ``folder`` (a GGUF-prepared folder or a safetensors one).

    Raises:
        ModelNotFoundError, CheckpointError: the folder holds no readable checkpoint.
    """
    from moespec.gguf import SOURCE_FILE

    folder = Path(folder)
    if (folder / SOURCE_FILE).is_file():
        from moespec.runtime.host.gguf_source import GgufSource

        return GgufSource.open(folder)
    return SafetensorsSource(folder)


def load_offloaded(path: str | Path, cfg: RuntimeConfig, recorder: StatsRecorder | None = None) -> OffloadedModel:
    """Load the checkpoint folder ``path`` (safetensors, or a folder moespec prepared for a GGUF) for
    offloaded inference; its weights come through one CheckpointSource (runtime.host.source).

    Raises:
        ModelNotFoundError, CheckpointError, UnsupportedModelError, BudgetError, DeviceError, OptionError,
        CalibrationError (a seeded cache policy's calibration file is missing or another model's).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from moespec.model_check import check_config

    path = Path(path)
    check_config(path, cfg.dtype)  # config.json faults in one line, not in transformers' traceback
    source = open_source(path)
    device = resolve_device(cfg.device)
    config = source.config()
    adapter = adapter_for(config)
    dtype = resolve_dtype(cfg.dtype, config)
    resolve_dense_dtype(cfg.dense_dtype, dtype, device)  # a --dense-dtype it cannot take: refused before loading
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    moe_layers = _moe_layers(model, adapter)

    layout = source.layout(adapter, dtype, cfg.expert_dtype, cfg.group_size, cfg.requantize)
    store_bytes = ExpertStore.bytes_needed(len(moe_layers), adapter.num_experts(), layout, dtype)
    expert_bytes = store_bytes // max(len(moe_layers) * adapter.num_experts(), 1)
    # Both budgets are checked before anything is allocated or pinned.
    needed = host_bytes_needed(model, store_bytes, device)
    on_disk = disk_tier.wanted(cfg, device, needed)
    if on_disk:  # the RAM tier is the cache: its rows come from --host-memory (disk_tier.ram_slots)
        dense = needed - store_bytes  # the dense weights that stay in host RAM
        stride = round_up(expert_bytes)  # a row's bytes in the file and in a RAM slot (O_DIRECT alignment)
        slots = disk_tier.ram_slots(cfg, adapter.top_k(), len(moe_layers) * adapter.num_experts(), stride, dense)
    else:
        slots = num_slots(cfg, adapter.top_k(), len(moe_layers) * adapter.num_experts(), expert_bytes)
    # A missing calibration file fails here, before anything is allocated.
    cache_policy = resolve_policy(cfg.cache_policy, path, cfg.calibration_path)
    if on_disk:
        check_host_memory(dense + slots * stride, f"{path.name} (dense part + the RAM tier of expert rows)")
        store = disk_tier.open_store(path, source, layout, dtype, moe_layers, adapter.num_experts(),
                                     disk_tier.fill_experts(source, adapter, device, dtype))[0]
        if cfg.disk_reads == "mmap":  # the baseline (README, "Experts on disk"): the page cache as cache
            store = store.mapped()
    else:
        check_host_memory(needed, f"{path.name} (experts in host RAM)")
        store = ExpertStore(moe_layers, adapter.num_experts(), layout, dtype, pin=device.type == "cuda", device=device)
    engine = om = pending = None
    try:  # whatever fails from here (a corrupt file, a stale calibration) unpins what was pinned
        direct = isinstance(store, DiskStore)
        engine = disk_tier.make_engine(store) if direct else make_transfer_engine(device, slots, cfg.link_gbps)
        cache = ExpertCache(store, slots, device, engine, None, prefetch_slots=adapter.top_k())  # rule: after loading
        recorder = recorder or NullRecorder()
        wire_recorder(recorder, engine)
        # Until the routers are loaded: no prediction, misses fetched (use_policy below sets cfg's).
        runner = MoeLayerRunner(adapter, cache, PrefetchLedger(cache), recorder,
                                LayerPolicy(NoPredictor(adapter, []), cfg.execute))

        refs = []
        for i in moe_layers:
            layer = model.model.layers[i]
            layer.mlp = OffloadedMoeBlock(layer.mlp, i, runner, adapter)
            refs.append(LayerRef(layer=i, norm=layer.post_attention_layernorm, block=layer.mlp))

        # Native norms; r_l, the input of the post-attention norm, recorded by it for the predictors.
        norms = install_norms(model, runner, moe_layers)

        # int8/int4 experts: a quantised store saved by an earlier start replaces reading the experts.
        saved = None if on_disk else QuantStoreCache.for_store(path, source.fingerprint, store)  # None: not quantised
        # Its rows are checked on a second thread while the dense weights load; joined before use.
        pending = saved.start_load(store) if saved is not None else None
        # On disk the rows are in the store file (checked per row as they are read).
        _load_weights(model, adapter, store, source, device, dtype, read_experts=not on_disk and pending is None)
        release_free_heap()  # the copies and casts loading freed (host/heap_trim.py): RSS under a cap
        from_cache = on_disk or (pending is not None and pending.wait())
        if pending is not None and not from_cache:  # damaged rows: read the experts from the checkpoint
            _load_weights(model, adapter, store, source, device, dtype, read_experts=True)
        unsaved = saved.save(store) if saved is not None and not from_cache else None  # a note, never fatal
        rule, note = _rule_factory(cfg, cache_policy, path, adapter.top_k(), slots, config, refs)  # checks its routers
        cache.set_rule(rule)
        predictor = make_predictor(cfg.predictor, adapter, refs, cfg, path)
        notes = [n for n in (note, unsaved, _kernel_note(device, cfg), *getattr(source, "notes", ())) if n]
        om = OffloadedModel(model, config, adapter, store, cache, runner, device, dtype, path, cfg, notes)
        om.dense = install_dense(model, cfg.dense_dtype, dtype, device)  # before compile: it wraps lm_head
        release_free_heap()  # the float weights it fused or moved onto 2 MB pages
        om.norms = norms
        om.routers = install_routers(model)  # one native call after each router's product (router_call.py)
        om.decode = install_decode_layers(model)  # lean decode steps (runtime/decode_layer.py)
        om.step = install_model_step(model)  # the one-token forward around them (runtime/decode_model.py)
        om.use_policy(LayerPolicy.from_config(cfg, predictor))
        om.compiled = apply_compile(om, cfg.compile)
    except BaseException:
        if pending is not None:
            pending.wait()  # its thread reads the buffer: joined before the buffer is freed
        if om is not None:
            om.close()
        else:
            if engine is not None:
                engine.close()
            store.close()
        raise
    return om


def _kernel_note(device: torch.device, cfg: RuntimeConfig) -> str | None:
    """The one-line note when experts will be computed on the CPU (a CPU run, or misses on the host)
    without the native kernels (moespec.kernels.native: no AVX2/FMA/F16C, no compiler, ...), or
    with AVX2 kernels on a CPU that has the AVX-512 ones turned off (native.isa_notice)."""
    if device.type != "cpu" and cfg.on_miss == OnMiss.FETCH:
        return None
    return native.status().note or native.isa_notice()


def _load_weights(model: nn.Module, adapter: MoeAdapter, store: ExpertStore, source: CheckpointSource,
                  device: torch.device, dtype: torch.dtype, read_experts: bool = True) -> None:
    from accelerate.utils import set_module_tensor_to_device

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for key, target, tensor, where, mapped in source.tensors(adapter, store.layout, device, dtype, read_experts):
        if key is not None:
            store.write(key.layer, key.expert, key.part, tensor, target)
            continue
        if target not in params and target not in buffers:
            continue  # e.g. rotary inv_freq saved by old exports; transformers ignores these too
        skeleton = params[target] if target in params else buffers[target]
        if tuple(tensor.shape) != tuple(skeleton.shape):
            raise CheckpointError(f"tensor {target} in {where} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(skeleton.shape)}")
        # The skeleton's dtype is the model dtype except where transformers keeps float32
        # (_keep_in_fp32_modules: DeepSeek/GLM router weights and e_score_correction_bias).
        keep = skeleton.dtype if skeleton.is_floating_point() else dtype
        if mapped and device.type == "cpu" and (tensor.dtype == keep or not tensor.is_floating_point()):
            # Out of the checkpoint's file mapping: a parameter viewing it would keep every page read
            # so far resident (checkpoint.iter_tensors). A cast or a device copy copies anyway.
            tensor = tensor.clone()
        set_module_tensor_to_device(model, target, device, value=tensor, dtype=keep)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}",
                              "the download is incomplete or the config does not match the weights")
    gaps = store.missing() if read_experts else []
    if gaps:
        raise CheckpointError(f"the checkpoint lacks {len(gaps)} expert tensor(s), e.g. {', '.join(gaps[:3])}",
                              "the download is incomplete or the config does not match the weights")
    for name, buf in list(model.named_buffers()):
        if buf.device != device:
            set_module_tensor_to_device(model, name, device, value=buf)
