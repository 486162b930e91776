"""vLLM plugin: ModelOpt NVFP4 MoE layers served by moed.

Installed with the client package as the entry point ``moed`` of the group
``vllm.general_plugins``, which vLLM loads in every process
(vllm/plugins/__init__.py, load_general_plugins). ``register()`` does
nothing unless ``MOED_SOCKET`` is set (see _plugin_common.enabled).

What it changes: ``ModelOptNvFp4Config.FusedMoEMethodCls``
(vllm/model_executor/layers/quantization/modelopt.py), the class that
``ModelOptQuantConfigBase.get_quant_method`` builds for every quantized
``RoutedExperts`` layer as ``FusedMoEMethodCls(quant_config=..,
moe_config=layer.moe_config)``, becomes ``MoedNvFp4FusedMoE``:

* ``create_weights`` registers placeholders of zero bytes under the names of
  ``ModelOptNvFp4FusedMoE.create_weights`` (w13_weight, w2_weight, their
  weight_scale, weight_scale_2 and input_scale), each with a weight_loader
  that drops the checkpoint's tensor and reports success; the shared experts
  (vLLM's SharedExperts, run by the MoE runner), the router and the rest load
  as usual;
* ``apply(layer, x, topk_weights, topk_ids, shared_experts,
  shared_experts_input)`` (FusedMoEMethodBase.apply in
  vllm/model_executor/layers/fused_moe/fused_moe_method_base.py) sends the
  batch to moed for the routed experts only: vLLM's runner computes the
  shared experts itself (runner/moe_runner.py, _apply_quant_method; with no
  modular kernel they run before apply, SharedExpertsOrder.NO_OVERLAP) and
  applies routed_scaling_factor to apply's output afterwards
  (_maybe_apply_routed_scale_to_output), so the weights go to moed as the
  router made them and the factor is applied once, by vLLM, as with its own
  kernels;
* TP: moe tp_rank 0 computes, the others return zeros (the runner's
  all-reduce sums them); EP: topk_ids are global ids and
  ``layer.expert_map`` maps them to this rank's experts (-1: another
  rank's); each EP rank asks moed for its own (EMPTY_SLOTS for the rest);
* refused at construction: data parallelism (dp_size > 1: the tokens of
  other DP ranks would reach moed only through vLLM's all-to-all kernels,
  which this method replaces) and EPLB (``supports_eplb`` False: vLLM then
  refuses --enable-eplb for these layers in RoutedExperts.__init__).
"""

import logging

from moed_client import _plugin_common as pc

log = logging.getLogger("moed_client.vllm_plugin")

_registered = False


def register():
    """Entry point (group vllm.general_plugins). Idempotent."""
    global _registered
    if _registered or not pc.enabled():
        return
    from vllm.model_executor.layers.quantization import modelopt as mo
    mo.ModelOptNvFp4Config.FusedMoEMethodCls = method_class()
    _registered = True
    log.info("moed: ModelOpt NVFP4 MoE layers go to the daemon on %s",
             __import__("os").environ.get(pc.ENV_SOCKET))


def parallel_of(moe_config):
    """(tp_rank, ep_rank, use_ep, dp_size) of a FusedMoEConfig."""
    p = moe_config.moe_parallel_config
    return p.tp_rank, p.ep_rank, bool(p.use_ep), p.dp_size


class _Method:
    """Body of MoedNvFp4FusedMoE (the class is made on first use, so this
    module imports without vLLM)."""

    def __init__(self, quant_config, moe_config, experts=None):
        self._base_init(moe_config)
        self.quant_config = quant_config
        self.experts = experts or pc.Experts(zero_copy_mode=pc.zero_copy())
        tp_rank, ep_rank, use_ep, dp_size = parallel_of(moe_config)
        if dp_size > 1:
            raise pc.MoedPluginError(
                "moed: data parallelism (dp_size %d) is not supported for MoE layers served "
                "by moed; use tensor or expert parallelism within one DP rank" % dp_size)
        self._checked = set()

    # -- weights (follows ModelOptNvFp4FusedMoE.create_weights) --------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        layer.num_experts = num_experts
        layer.params_dtype = params_dtype
        layer.quant_config = self.quant_config
        pc.add_placeholders(layer, num_experts)

    def process_weights_after_loading(self, layer):
        pc.check_placeholders(layer)

    def get_fused_moe_quant_config(self, layer):
        return None

    @property
    def supports_eplb(self):
        return False

    # -- forward ----------------------------------------------------------------
    def routing(self, layer, topk_weights, topk_ids):
        """(logical ids, weights, any_empty, compute)."""
        np = pc._np()
        tp_rank, ep_rank, use_ep, _ = parallel_of(self.moe)
        info = self.experts.info()
        n_global = getattr(layer, "global_num_experts", info.n_experts)
        layer_id = self.layer_id(layer)
        if layer_id not in self._checked:
            self.experts.check_layer(layer_id, n_global)
            self._checked.add(layer_id)
        table = pc.id_table(n_global, info.n_experts)
        expert_map = getattr(layer, "expert_map", None)
        if use_ep and expert_map is not None:
            local = pc.to_numpy(expert_map, np.int64) >= 0
            table = np.where(local, table, -1).astype(np.int32)
        if self.experts.on_device(topk_ids):  # MOED_ZERO_COPY=doorbell
            ids, w = pc.device_routing(topk_ids, topk_weights,
                                       pc.device_table(table, topk_ids.device), info.n_experts)
            any_empty = True
        else:
            ids, any_empty = pc.map_ids(topk_ids, table)
            w = pc.to_numpy(topk_weights, np.float32)
        compute, _ = pc.rank_role(tp_rank, ep_rank, framework_serves_shared=True)
        return ids, w, any_empty, compute

    @staticmethod
    def layer_id(layer):
        """The absolute layer index from the layer's name
        (model.layers.N.mlp.experts...), as moed numbers layers."""
        lid = getattr(layer, "layer_id", None)
        if lid is not None:
            return int(lid)
        name = getattr(layer, "layer_name", None) or getattr(layer, "prefix", "")
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part == "layers" and parts[i + 1].isdigit():
                return int(parts[i + 1])
        raise pc.MoedPluginError("moed: cannot tell the layer index of MoE layer %r" % name)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None,
              shared_experts_input=None):
        ids, w, any_empty, compute = self.routing(layer, topk_weights, topk_ids)
        if not compute:
            import torch
            return torch.zeros_like(x)
        return self.experts.forward(self.layer_id(layer), x, ids, w, routed_only=True,
                                    empty_slots=any_empty)


_cls = None


def method_class():
    """MoedNvFp4FusedMoE: _Method on vLLM's FusedMoEMethodBase."""
    global _cls
    if _cls is None:
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
            FusedMoEMethodBase)

        def _base_init(self, moe_config):
            FusedMoEMethodBase.__init__(self, moe_config)

        _cls = type("MoedNvFp4FusedMoE", (_Method, FusedMoEMethodBase),
                    {"_base_init": _base_init})
    return _cls
