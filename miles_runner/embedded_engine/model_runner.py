"""The torch side of the embedded engine: one HF causal LM, batched forwards, LoRA adapters, expert routing.

- Forwards are ragged (``ragged_batch``): rows with different cache lengths and new-token counts share one
  pass; each row keeps its own KV cache between steps, so requests join and leave between any two steps.
- KV: a layer's cache is whatever tensors its attention caches, each with its own shape (``hf_cache``): keys and
  values, or MLA's latent and rope key plus a DSA indexer's keys (GLM-5).
- Routing: a forward hook on every MoE router (``mlp.gate``) records the top-k expert ids it chose for
  every token; dense layers read 0, like SGLang's zero-initialised capture buffer.
- LoRA: adapters live in one ``peft.PeftModel``; a batch mixes adapters through peft's ``adapter_names``
  (``"__base__"`` = no adapter). Adapters that wrap parameters (``target_parameters``, e.g. MoE experts)
  cannot mix in one pass, so while one is loaded each adapter's rows run as their own pass.
- An adapter loaded from tensors and then unloaded is parked, not deleted (one at most): a load of the same name
  and config, the colocated sync's unload-then-load, copies the new tensors into its weights instead of building
  peft's modules again (most of a sync's time; bench/adapter_sync_bandwidth.py), as SGLang's LoRA memory pool
  reuses its buffers. A broadcast load receives straight into them (``parked_weights``) and copies nothing. A
  parked adapter is never served (the engine's registry no longer names it); any other load deletes it first.
- Every change of weights bumps a generation (the base's, or the adapter's), and prefix-cache entries carry the one
  their KV was computed under (``kv_generation``): KV of replaced weights is never reused.
- Only the scheduler's worker thread calls into this class, so no locking is needed here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles_runner.embedded_engine.hf_cache import build_cache, cache_argument, read_cache
from miles_runner.embedded_engine.ragged_batch import LayerCache, RaggedLayout

logger = logging.getLogger(__name__)

KVCache = list[LayerCache]  # one row's cache: per layer its cached tensors, each (heads, tokens, dim)
# peft needs at least one adapter to keep its wrapper alive; this one is zero-initialised and never selected.
PLACEHOLDER_ADAPTER = "__embedded_placeholder__"
BASE_ADAPTER = "__base__"


@dataclass
class RowInput:
    cache: KVCache | None
    cache_len: int
    new_tokens: list[int]
    adapter: str | None
    all_logits: bool = False  # keep logits for every new token (prompt logprobs), not only the last


@dataclass(frozen=True)
class TensorAdapter:
    config_dict: dict  # as the load was given it: a reload with the same config may reuse the weights
    weights: dict[str, torch.Tensor]  # peft state-dict key -> the adapter's own parameter (shares its storage)


@dataclass
class RowOutput:
    logits: torch.Tensor  # (n_new, vocab) when all_logits, else (1, vocab)
    cache: KVCache
    routing: np.ndarray | None  # (n_new, num_layers, top_k) int32, None for a dense model


class ModelRunner:
    def __init__(self, model_path: str, *, enable_lora: bool, lora_target_modules: list[str] | None = None):
        from transformers import AutoConfig

        self.model_path = model_path
        self.config = AutoConfig.from_pretrained(model_path)
        self.model = _load_model(model_path).eval()
        self.cache_argument = cache_argument(self.model)
        text_config = self.config.get_text_config()
        self.num_layers: int = text_config.num_hidden_layers
        self.vocab_size: int = text_config.vocab_size
        self.top_k: int = int(getattr(text_config, "num_experts_per_tok", 0) or 0)
        self._routing_capture: dict[int, torch.Tensor] = {}
        self.moe_layers = self._hook_routers()
        self._mixable_for: tuple = ()  # the (name, config) of the loaded adapters _mixable was found for
        self._mixable = True
        self.peft = self._wrap_for_lora(lora_target_modules) if enable_lora else None
        self._from_tensors: dict[str, TensorAdapter] = {}  # adapters loaded from tensors, parked ones included
        self._parked: str | None = None
        self._base_generation = 0
        self._adapter_generations: dict[str | None, int] = {}
        self._released: dict[str, torch.Tensor] | None = None  # base weights released: their backup, or {}

    def kv_generation(self, adapter: str | None) -> tuple[int, int]:
        """Changes whenever the weights that a request of `adapter` runs with may have changed."""
        return self._base_generation, self._adapter_generations.get(adapter, 0)

    def _adapter_changes(self, name: str) -> None:
        self._adapter_generations[name] = self._adapter_generations.get(name, 0) + 1

    # ----- routing capture -------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers) and self.top_k > 0

    def _hook_routers(self) -> list[int]:
        layers = []
        for index, layer in enumerate(self.model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                gate.register_forward_hook(self._make_router_hook(index))
                layers.append(index)
        return layers

    def _make_router_hook(self, layer_index: int):
        def hook(_module, _inputs, output):
            # Qwen3-MoE's and GLM-5's routers both return (logits, top-k weights, top-k indices), the indices in the
            # router's own order: Qwen3's sorted by weight, GLM's grouped top-k unsorted, as SGLang's kernel leaves it.
            self._routing_capture[layer_index] = output[2].detach()

        return hook

    def _routing_for_batch(self, batch: int, width: int) -> np.ndarray | None:
        if not self.is_moe:
            return None
        routing = np.zeros((batch, width, self.num_layers, self.top_k), dtype=np.int32)
        for layer, indices in self._routing_capture.items():
            routing[:, :, layer, :] = indices.reshape(batch, width, self.top_k).numpy()
        self._routing_capture.clear()
        return routing

    # ----- forward -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, rows: list[RowInput], pad_id: int) -> list[RowOutput]:
        """Run the rows, grouped so that each group is one forward pass."""
        outputs: dict[int, RowOutput] = {}
        for group in self._forward_groups(rows):
            for index, out in zip(group, self._forward_group([rows[i] for i in group], pad_id), strict=True):
                outputs[index] = out
        return [outputs[i] for i in range(len(rows))]

    def _forward_groups(self, rows: list[RowInput]) -> list[list[int]]:
        if self.peft is None or self._adapters_mix_in_one_pass(self.peft):
            return [list(range(len(rows)))]
        by_adapter: dict[str | None, list[int]] = {}
        for index, row in enumerate(rows):
            by_adapter.setdefault(row.adapter, []).append(index)
        return list(by_adapter.values())

    def _forward_group(self, rows: list[RowInput], pad_id: int) -> list[RowOutput]:
        layout = RaggedLayout([r.cache_len for r in rows], [len(r.new_tokens) for r in rows])
        cache = build_cache(self.config, layout.stack_cache([r.cache for r in rows]))
        kwargs = {
            "input_ids": layout.input_ids([r.new_tokens for r in rows], pad_id),
            "position_ids": layout.position_ids(),
            "attention_mask": layout.attention_mask(),
            self.cache_argument: cache,
            "use_cache": True,
        }
        logits = self._call_model([r.adapter for r in rows], kwargs).logits
        routing = self._routing_for_batch(len(rows), layout.new_width)
        layer_states = read_cache(cache)
        outputs = []
        for index, row in enumerate(rows):
            row_logits = layout.new_rows(logits, index) if row.all_logits else logits[index, -1:]
            row_routing = layout.new_rows(routing, index) if routing is not None else None
            outputs.append(RowOutput(row_logits, layout.split_cache(layer_states, index), row_routing))
        return outputs

    def _call_model(self, adapters: list[str | None], kwargs: dict):
        if self.peft is None:
            return self.model(**kwargs)
        if len(set(adapters)) > 1 and self._adapters_mix_in_one_pass(self.peft):
            # PeftModel.forward routes each row through its own adapter via peft's mixed-batch hooks.
            return self.peft(**kwargs, adapter_names=[a or BASE_ADAPTER for a in adapters])
        # One adapter per pass (every row's, the common case, without the per-row hooks of a mixed batch); the zero
        # placeholder stands in for "no adapter".
        self.peft.set_adapter(adapters[0] or PLACEHOLDER_ADAPTER)
        return self.peft(**kwargs)

    # ----- LoRA --------------------------------------------------------------------------------------------
    def _wrap_for_lora(self, target_modules: list[str] | None):
        from peft import LoraConfig, get_peft_model

        targets = [m for m in (target_modules or []) if m != "all"] or [self._placeholder_target()]
        placeholder = LoraConfig(r=1, lora_alpha=1, target_modules=targets, init_lora_weights=True)
        return get_peft_model(self.model, placeholder, adapter_name=PLACEHOLDER_ADAPTER).eval()

    def _placeholder_target(self) -> str:
        """The module the zero placeholder wraps when no targets are given: q_proj, else o_proj (an MLA model with a
        query LoRA rank has q_a_proj and q_b_proj instead); a zero adapter changes nothing wherever it sits."""
        leaves = {name.rpartition(".")[2] for name, _ in self.model.named_modules()}
        return next(name for name in ("q_proj", "o_proj") if name in leaves)

    def _adapters_mix_in_one_pass(self, peft: Any) -> bool:
        """Whether no loaded adapter wraps parameters; asked every forward, so the module walk runs only when the
        set of loaded adapters has changed since the last answer."""
        loaded = tuple(peft.peft_config.items())  # held: a config object is never mistaken for a later one
        if len(loaded) != len(self._mixable_for) or any(
            name != seen or config is not seen_config
            for (name, config), (seen, seen_config) in zip(loaded, self._mixable_for, strict=True)
        ):
            from peft.tuners.lora.layer import ParamWrapper

            self._mixable = not any(isinstance(m, ParamWrapper) for m in peft.modules())
            self._mixable_for = loaded
        return self._mixable

    def load_adapter_from_path(self, name: str, path: str) -> None:
        peft = self._require_lora()
        self._adapter_changes(name)
        self._drop_parked()
        try:
            peft.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception:  # a refused load leaves nothing behind, so the name can be loaded again
            if name in peft.peft_config:
                peft.delete_adapter(name)
            raise
        peft.eval()

    def load_adapter_from_tensors(
        self, name: str, config_dict: dict, tensors: dict[str, torch.Tensor], *, borrowed: bool = False
    ) -> None:
        """Load `tensors` as adapter `name`. They become its weights unless `borrowed` (views of memory the caller
        keeps, such as a shared-memory segment): then they are copied."""
        self._adapter_changes(name)
        if self._reload_parked(name, config_dict, tensors):
            return
        self._drop_parked()
        from peft import set_peft_model_state_dict

        peft = self._require_lora()
        # The adapter's weights start on the meta device and the received tensors become them (assign): no random
        # init of weights about to be overwritten, and no copy of tensors the caller just decoded or received,
        # which nothing else holds (bench/adapter_sync_bandwidth.py).
        peft.add_adapter(name, _inference_lora_config(config_dict), low_cpu_mem_usage=True)
        dtype = self.model.dtype  # as a copy into the adapter's own weights would have cast them
        try:
            owned = {key: tensor.to(dtype, copy=borrowed) for key, tensor in tensors.items()}
            result = set_peft_model_state_dict(peft, owned, adapter_name=name, low_cpu_mem_usage=True)
        except Exception as exc:  # shapes that do not fit the config: the request's fault, a 400
            peft.delete_adapter(name)
            raise ValueError(f"adapter tensors do not match the config: {exc}") from exc
        missing = [k for k in result.missing_keys if f".{name}." in k or k.endswith(f".{name}")]
        if missing or result.unexpected_keys:
            peft.delete_adapter(name)
            raise ValueError(
                f"adapter tensors do not match the config: missing {missing[:4]}, "
                f"unexpected {list(result.unexpected_keys)[:4]}"
            )
        peft.eval()
        self._from_tensors[name] = TensorAdapter(dict(config_dict), owned)  # `owned` became its parameters

    def replace_adapter_weights(self, name: str, config_dict: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite a loaded adapter's weights in place (an upsert): same tensor names, shapes and scaling,
        checked before anything is written, so a refused upsert leaves the adapter as it was."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        peft = self._require_lora()
        if name not in peft.peft_config or name == self._parked:
            raise ValueError(f"LoRA adapter {name} is not loaded; it cannot be updated in place")
        if _scaling_fields(peft.peft_config[name]) != _scaling_fields(_inference_lora_config(config_dict)):
            raise ValueError(f"an in-place update cannot change the r, lora_alpha or use_rslora of adapter {name}")
        current = get_peft_model_state_dict(peft, adapter_name=name)
        given = {key: tuple(t.shape) for key, t in tensors.items()}
        expected = {key: tuple(t.shape) for key, t in current.items()}
        if given != expected:
            differ = sorted(set(given.items()) ^ set(expected.items()))[:4]
            raise ValueError(f"tensors for an in-place update of {name} differ in names or shapes: {differ}")
        self._adapter_changes(name)
        set_peft_model_state_dict(peft, tensors, adapter_name=name)

    def unload_adapter(self, name: str) -> None:
        peft = self._require_lora()
        if name not in peft.peft_config or name == self._parked:
            raise ValueError(f"LoRA adapter {name} is not loaded")
        self._adapter_changes(name)
        self._drop_parked()
        if name in self._from_tensors:
            self._parked = name  # kept for a reload of the same name and config (see the module's docstring)
        else:
            peft.delete_adapter(name)

    def parked_weights(
        self, name: str, config_dict: dict, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]
    ) -> dict[str, torch.Tensor] | None:
        """The parked adapter's own weights when a load of `name` with this config and these tensor names,
        shapes and dtypes (the engine's, so no cast) would reuse them; None otherwise. A receiver may write the
        tensors straight into them and hand them to `load_adapter_from_tensors`, which then copies nothing.
        Writing is safe while the engine's LoRA lock is held: a parked adapter is never served, and only a load,
        which writes every tensor, revives it."""
        parked = self._reusable_parked(name, config_dict, shapes)
        if parked is None or any(dtypes[key] != w.dtype for key, w in parked.weights.items()):
            return None
        return dict(parked.weights)

    def _reload_parked(self, name: str, config_dict: dict, tensors: dict[str, torch.Tensor]) -> bool:
        """Copy `tensors` into the parked adapter's weights when it has this name, config, tensor names and
        shapes; then it is loaded again. False (nothing written) otherwise."""
        parked = self._reusable_parked(name, config_dict, {key: tuple(t.shape) for key, t in tensors.items()})
        if parked is None:
            return False
        with torch.no_grad():
            for key, tensor in tensors.items():
                if tensor is not parked.weights[key]:  # received in place (parked_weights): already there
                    parked.weights[key].copy_(tensor)  # casts to the engine's dtype, as a fresh load does
        self._parked = None
        return True

    def _reusable_parked(
        self, name: str, config_dict: dict, shapes: dict[str, tuple[int, ...]]
    ) -> TensorAdapter | None:
        parked = self._from_tensors.get(name) if name == self._parked else None
        if parked is None or parked.config_dict != config_dict:
            return None
        return parked if shapes == {key: tuple(w.shape) for key, w in parked.weights.items()} else None

    def _drop_parked(self) -> None:
        if self._parked is not None:
            self._require_lora().delete_adapter(self._parked)
            del self._from_tensors[self._parked]
            self._parked = None

    def _require_lora(self):
        if self.peft is None:
            raise ValueError("LoRA is not enabled; start the engine with --enable-lora")
        return self.peft

    # ----- base weights ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        """Copy HF-named base weights into the model (LoRA-wrapped modules included); return how many."""
        if self.weights_released:
            raise ValueError("the weights are released: resume_memory_occupation (tag weights) before updating them")
        params = dict(self.model.named_parameters())
        resolved = {}
        for name, tensor in named_tensors.items():
            target = params.get(name)
            if target is None:
                target = params.get(_base_layer_name(name))
            if target is None:
                raise ValueError(f"unknown parameter {name!r} for this model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name}: model {tuple(target.shape)}, got {tuple(tensor.shape)}")
            resolved[name] = target
        self._base_generation += 1
        for name, target in resolved.items():
            target.copy_(named_tensors[name].to(target.dtype))
        return len(resolved)

    def update_weights_from_disk(self, model_path: str) -> int:
        if not Path(model_path).is_dir():
            raise ValueError(f"model path {model_path} is not a directory")
        return self.update_weights(dict(_load_model(model_path).named_parameters()))

    # ----- memory occupation (the weights tag of SGLang's release/resume_memory_occupation) ---------------------
    @property
    def weights_released(self) -> bool:
        return self._released is not None

    def _base_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The base model's parameters (a tied embedding once); the adapters' stay: SGLang's LoRA buffers are
        outside the memory saver's weights region, so adapters survive a release."""
        return {name: p for name, p in self.model.named_parameters() if "lora_" not in name}

    def release_weights(self, *, keep_backup: bool) -> int:
        """Empty every base parameter; return the bytes whose storage is freed. `keep_backup`
        (--enable-weights-cpu-backup) keeps each tensor to restore from: on a CPU host that backup is the
        weights' own memory, so nothing is freed."""
        params = self._base_parameters()
        self._released = {name: p.data for name, p in params.items()} if keep_backup else {}
        freed = 0 if keep_backup else sum(p.data.nbytes for p in params.values())
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype)
        return freed

    def resume_weights(self, model_path: str) -> int:
        """Give every base parameter its weights again: from the backup, else loaded from `model_path` (SGLang
        gives back uninitialised memory there and miles sends the base again; for LoRA the base it sends is the
        model path's). Return the bytes restored."""
        if self._released is None:
            raise ValueError("the weights are not released")
        backup = self._released or _hf_named(self._base_parameters(), dict(_load_model(model_path).named_parameters()))
        for name, p in self._base_parameters().items():
            p.data = backup[name]
        self._released = None
        self._base_generation += 1  # the prefix cache's KV was computed under the weights as they were
        return sum(p.data.nbytes for p in self._base_parameters().values())


def _load_model(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")


def _hf_named(params: dict[str, torch.nn.Parameter], fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`fresh`'s tensors (a model loaded anew, HF names) under the names of `params` (peft's base_layer ones, one
    per adapter type that wraps the module)."""
    return {name: fresh[re.sub(r"(\.base_layer)+\.", ".", name)].data for name in params}


def _inference_lora_config(config_dict: dict):
    from peft import LoraConfig

    config = LoraConfig(**{k: v for k, v in config_dict.items() if k in LoraConfig.__dataclass_fields__})
    config.inference_mode = True
    return config


def _scaling_fields(config) -> tuple:
    return config.r, config.lora_alpha, config.use_rslora


def _base_layer_name(name: str) -> str:
    """``a.b.q_proj.weight`` -> ``a.b.q_proj.base_layer.weight`` (the name once peft wraps the module)."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.base_layer.{leaf}"
