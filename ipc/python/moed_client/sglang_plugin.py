"""SGLang plugin: ModelOpt NVFP4 MoE layers served by moed.

Installed with the client package as the entry point ``moed`` of the group
``sglang.srt.plugins``; SGLang's ``load_plugins()``
(python/sglang/srt/plugins/__init__.py) runs ``register()`` early in every
process it starts (engine, scheduler and TP workers, which are spawned, so a
patch in a launcher script would not reach them). ``register()`` does
nothing unless ``MOED_SOCKET`` is set (see _plugin_common.enabled).

What it changes: ``ModelOptFp4Config.get_quant_method``
(python/sglang/srt/layers/quantization/modelopt_quant.py) returns
``MoedFusedMoEMethod`` instead of ``ModelOptNvFp4FusedMoEMethod`` for the
NVFP4 ``FusedMoE`` layers it would quantize. That method

* creates placeholder parameters of zero bytes under the names the loader
  maps the checkpoint's expert tensors to (``FusedMoE.make_expert_params_mapping``
  in python/sglang/srt/layers/moe/fused_moe_triton/layer.py: experts.w13_* /
  experts.w2_*), each with a weight_loader that drops the tensor: no expert
  weight is allocated or copied on the serving GPU. The router, the shared
  experts SGLang keeps as their own module, attention and the rest load
  as usual;
* declares no MoE runner (``get_moe_runner_backend`` None: "a direct kernel
  consuming standard TopK with local IDs", FusedMoEMethodBase in
  python/sglang/srt/layers/quantization/base_config.py);
* sets ``fuse_routed_scaling_factor_in_topk``, so that
  ``_fuses_routed_scaling_factor_in_topk`` (fused_moe_triton/layer.py) makes
  SGLang's TopK fold routed_scaling_factor into the weights; apply() still
  reads ``layer.should_fuse_routed_scaling_factor_in_topk`` and multiplies
  the factor in itself when it is False (as the Marlin NVFP4 path does), so
  the factor is applied exactly once;
* in apply() reads ``StandardTopKOutput`` by attribute, materializes a
  ``BypassedTopKOutput`` with ``to_standard()`` (as KTEPWrapperMethod does,
  python/sglang/srt/layers/moe/kt_ep_wrapper.py), refuses
  ``TritonKernelTopKOutput`` and dispatch outputs without ``topk_output``
  (DeepEP and other all-to-all backends), and sends the batch to moed.

Parallelism (see _plugin_common.rank_role): under TP the rank with
moe_tp_rank 0 computes and the others return zeros, so the all-reduce sum is
the layer's output; under EP the StandardDispatcher
(python/sglang/srt/layers/moe/token_dispatcher/standard.py) has already
turned ids into this rank's local ids (-1 for other ranks' experts): each EP
rank asks moed for its own experts (EMPTY_SLOTS for the -1s) and only EP
rank 0 for the shared experts. EPLB physical ids go back to logical ids
through ``get_global_expert_location_metadata().physical_to_logical_map_cpu``
(python/sglang/srt/eplb/expert_location_dispatch.py), read on every call
because rebalancing changes it. Fused shared experts
(num_fused_shared_experts > 0): their top-k columns are dropped and moed
adds the shared experts (weight 1); otherwise SGLang computes them and moed
is asked for the routed experts only.
"""

import logging

from moed_client import _plugin_common as pc

log = logging.getLogger("moed_client.sglang_plugin")

_registered = False


def register():
    """Entry point (group sglang.srt.plugins). Idempotent."""
    global _registered
    if _registered or not pc.enabled():
        return
    from sglang.srt.layers.quantization import modelopt_quant as mq

    orig = mq.ModelOptFp4Config.get_quant_method

    def get_quant_method(self, layer, prefix):
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
        if (isinstance(layer, FusedMoE) and self.is_checkpoint_nvfp4_serialized
                and not self.is_layer_excluded(prefix)):
            return MoedFusedMoEMethod(self)
        return orig(self, layer, prefix)

    get_quant_method.__wrapped__ = orig
    mq.ModelOptFp4Config.get_quant_method = get_quant_method
    _registered = True
    log.info("moed: ModelOpt NVFP4 MoE layers go to the daemon on %s",
             __import__("os").environ.get(pc.ENV_SOCKET))


def _method_base():
    from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
    return FusedMoEMethodBase


def _eplb_p2l(layer_id):
    """EPLB's physical -> logical map of the layer, or None without EPLB."""
    try:
        from sglang.srt.eplb.expert_location_dispatch import (
            get_global_expert_location_metadata)
        meta = get_global_expert_location_metadata()
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return None  # no SGLang runtime context (tests): no EPLB
    if meta is None:
        return None
    return meta.physical_to_logical_map_cpu[layer_id]


class _Method:
    """Body of MoedFusedMoEMethod; the class itself is made on first use so
    that this module imports without SGLang (the unit tests)."""

    # read by _fuses_routed_scaling_factor_in_topk (fused_moe_triton/layer.py)
    fuse_routed_scaling_factor_in_topk = True
    runner = None

    def __init__(self, quant_config, experts=None):
        self.quant_config = quant_config
        self.experts = experts or pc.Experts(zero_copy_mode=pc.zero_copy())
        self.moe_runner_config = None
        self._checked = set()

    # -- weights (follows ModelOptNvFp4FusedMoEMethod.create_weights) --------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        layer.intermediate_size_per_partition = intermediate_size_per_partition
        layer.params_dtype = params_dtype
        layer.quant_config = self.quant_config
        pc.add_placeholders(layer, num_experts)

    def process_weights_after_loading(self, layer):
        pc.check_placeholders(layer)

    # -- runner (FusedMoEMethodBase) ------------------------------------------
    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config

    def get_moe_runner_backend(self, layer):
        return None

    def get_moe_routing_method_type(self, layer, requested_method):
        return requested_method

    # -- forward ----------------------------------------------------------------
    def routing(self, layer, dispatch_output):
        """(x, logical ids, final weights, any_empty, routed_only, compute)."""
        from sglang.srt.layers.moe.topk import TopKOutputChecker
        topk_output = getattr(dispatch_output, "topk_output", None)
        if topk_output is None:
            raise pc.MoedPluginError(
                "moed: dispatch output %s carries no topk_output (DeepEP or another all-to-all "
                "backend): not supported, run with --moe-a2a-backend none"
                % type(dispatch_output).__name__)
        local_ids = getattr(layer, "moe_ep_size", 1) > 1
        if TopKOutputChecker.format_is_bypassed(topk_output):
            # the dispatcher maps only standard outputs to local ids
            topk_output = topk_output.to_standard()
            local_ids = False
        if not TopKOutputChecker.format_is_standard(topk_output):
            raise pc.MoedPluginError(
                "moed: top-k output %s has no topk_ids/topk_weights (triton_kernels runner?): "
                "not supported" % type(topk_output).__name__)
        cfg = layer.moe_runner_config
        n_shared_slots = getattr(layer, "num_fused_shared_experts", 0) or 0
        n_global_routed = getattr(layer, "num_global_routed_experts", None)
        if n_global_routed is None:
            n_global_routed = layer.num_experts - n_shared_slots
        info = self.experts.info()
        if layer.layer_id not in self._checked:
            p2l0 = _eplb_p2l(layer.layer_id)
            n_logical = n_global_routed if p2l0 is None else int(max(p2l0)) + 1
            self.experts.check_layer(layer.layer_id, n_logical)
            if n_shared_slots and not info.n_shared:
                raise pc.MoedPluginError(
                    "moed: SGLang fuses %d shared expert(s) into layer %d but the daemon's model "
                    "has none" % (n_shared_slots, layer.layer_id))
            self._checked.add(layer.layer_id)
        if local_ids:
            n_local_routed = layer.num_local_experts - n_shared_slots
            table = pc.id_table(layer.num_local_experts, info.n_experts,
                                n_routed_incoming=n_local_routed,
                                offset=layer.moe_ep_rank * n_local_routed,
                                p2l=_eplb_p2l(layer.layer_id))
            n_routed_in = n_local_routed
        else:
            table = pc.id_table(layer.num_experts, info.n_experts,
                                n_routed_incoming=n_global_routed,
                                p2l=_eplb_p2l(layer.layer_id))
            n_routed_in = n_global_routed
            ep_size = getattr(layer, "moe_ep_size", 1)
            if ep_size > 1:  # global ids on an EP rank: keep this rank's experts
                n_local_routed = n_global_routed // ep_size
                lo = layer.moe_ep_rank * n_local_routed
                table[:lo] = -1
                table[lo + n_local_routed:] = -1
        fused_scale = getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False)
        if self.experts.on_device(topk_output.topk_ids):  # MOED_ZERO_COPY=doorbell
            ids, w = pc.device_routing(
                topk_output.topk_ids, topk_output.topk_weights,
                pc.device_table(table, topk_output.topk_ids.device), info.n_experts,
                n_shared_cols=n_shared_slots,
                scale=None if fused_scale else cfg.routed_scaling_factor)
            any_empty = True
        else:
            ids, w = pc.drop_shared_columns(topk_output.topk_ids, topk_output.topk_weights,
                                            n_shared_slots, n_routed_in)
            ids, any_empty = pc.map_ids(ids, table)
            w = pc.final_weights(w, cfg.routed_scaling_factor, fused_scale)
        compute, routed_only = pc.rank_role(getattr(layer, "moe_tp_rank", 0),
                                            getattr(layer, "moe_ep_rank", 0),
                                            framework_serves_shared=n_shared_slots == 0)
        return dispatch_output.hidden_states, ids, w, any_empty, routed_only, compute

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        x, ids, w, any_empty, routed_only, compute = self.routing(layer, dispatch_output)
        if not compute:
            import torch
            return StandardCombineInput(hidden_states=torch.zeros_like(x))
        y = self.experts.forward(layer.layer_id, x, ids, w, routed_only=routed_only,
                                 empty_slots=any_empty)
        return StandardCombineInput(hidden_states=y)


_cls = None


def method_class():
    """MoedFusedMoEMethod: _Method on SGLang's FusedMoEMethodBase."""
    global _cls
    if _cls is None:
        _cls = type("MoedFusedMoEMethod", (_Method, _method_base()), {})
    return _cls


def MoedFusedMoEMethod(quant_config, experts=None):
    return method_class()(quant_config, experts)
