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

* ``create_weights`` registers placeholders of zero bytes (one per expert
  with EPLB, see below) under the names of
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
* DP (dp_size > 1): with no modular kernel of its own the method runs
  inside the MoE runner's naive dispatch/combine (MoERunner.
  do_naive_dispatch_combine, runner/moe_runner.py: dp_size > 1 and not
  supports_internal_mk): the all2all manager's dispatch_router_logits
  all-gathers every DP rank's tokens before apply and combine
  reduce-scatters the sum after it, so apply sees the same gathered batch
  on every rank. Without EP, FusedMoEParallelConfig.make flattens TP across
  DP (tp_rank = dp_rank * tp_size + tp_rank), so exactly one rank of the
  whole DP x TP group asks moed and the sum is the layer; with EP each rank
  asks for its own experts. Refused: DP with EP on an all2all backend other
  than allgather_reducescatter / naive (all2all_utils.
  maybe_make_prepare_finalize builds that backend's prepare/finalize and
  FusedMoE.maybe_init_modular_kernel replaces this method by a modular
  kernel, whose select_gemm_impl the method cannot provide), and prefill
  context parallelism with EP (its tokens are not gathered for apply);
* EPLB (``supports_eplb`` True): vLLM's router turns logical ids into
  physical ones and records the expert load itself, before apply
  (router/base_router.py, BaseRouter._apply_eplb_mapping ->
  eplb_map_to_physical_and_record: one replica per token from
  logical_to_physical_map, an atomic add into expert_load_view), so the
  method only maps physical ids back: through the layer's own
  EplbLayerState.logical_to_physical_map (MoERunner.eplb_state, found by
  layer_name in the forward context as vLLM's moe_forward op finds the
  runner), read on every call because EplbState rearranges it in place
  (eplb_state.py, _commit_eplb_maps). The expert placeholders get one byte
  per expert (RoutedExperts.get_expert_weights views each as
  [local experts, -1], which an empty tensor cannot be); EPLB's weight
  moves carry those bytes and nothing else.
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


# all2all backends under which vLLM keeps calling the method's apply() with
# the tokens of every DP rank gathered (the runner's naive dispatch/combine:
# AgRsAll2AllManager / NaiveAll2AllManager, distributed/device_communicators/
# all2all.py); any other builds its own prepare/finalize kernels
GATHERING_BACKENDS = ("allgather_reducescatter", "naive")


def check_parallel(p):
    """Refuse a FusedMoEParallelConfig the method cannot serve correctly."""
    use_ep = bool(p.use_ep)
    if use_ep and getattr(p, "pcp_size", 1) > 1:
        raise pc.MoedPluginError(
            "moed: prefill context parallelism (pcp_size %d) with expert parallelism is not "
            "supported for MoE layers served by moed" % p.pcp_size)
    if p.dp_size > 1 and use_ep and p.all2all_backend not in GATHERING_BACKENDS:
        raise pc.MoedPluginError(
            "moed: data parallelism (dp_size %d) with expert parallelism over the all2all "
            "backend %r is not supported for MoE layers served by moed (vLLM would run that "
            "backend's kernels instead of the method); use --all2all-backend "
            "allgather_reducescatter" % (p.dp_size, p.all2all_backend))


class _Method:
    """Body of MoedNvFp4FusedMoE (the class is made on first use, so this
    module imports without vLLM)."""

    def __init__(self, quant_config, moe_config, experts=None):
        self._base_init(moe_config)
        self.quant_config = quant_config
        self.experts = experts or pc.Experts(zero_copy_mode=pc.zero_copy())
        check_parallel(moe_config.moe_parallel_config)
        self._checked = set()
        self._layers = None  # layer name -> MoE runner (tests); None: vLLM's forward context

    # -- weights (follows ModelOptNvFp4FusedMoE.create_weights) --------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        layer.num_experts = num_experts
        layer.params_dtype = params_dtype
        layer.quant_config = self.quant_config
        eplb = bool(self.moe.moe_parallel_config.enable_eplb)
        pc.add_placeholders(layer, num_experts, row_bytes=1 if eplb else 0)

    def process_weights_after_loading(self, layer):
        pc.check_placeholders(layer)

    def get_fused_moe_quant_config(self, layer):
        return None

    @property
    def supports_eplb(self):
        return True

    def eplb_map(self, layer):
        """The layer's EPLB logical -> physical map ([logical, max replicas],
        -1 padded) as the router reads it in this forward: the
        EplbLayerState of the layer's MoE runner (MoERunner.eplb_state, its
        router's), looked up by layer_name in the forward context
        (ForwardContext.no_compile_layers, where vLLM's moe_forward op finds
        the runner, runner/moe_runner.py get_layer_from_name)."""
        layers = self._layers
        if layers is None:
            from vllm.forward_context import get_forward_context
            layers = get_forward_context().no_compile_layers
        owner = layers.get(layer.layer_name)
        state = getattr(owner, "eplb_state", None)
        if state is None:
            state = getattr(getattr(owner, "router", None), "eplb_state", None)
        l2p = getattr(state, "logical_to_physical_map", None)
        if l2p is None:
            raise pc.MoedPluginError(
                "moed: EPLB is on but MoE layer %r has no EPLB map (no runner with an "
                "eplb_state under that name in the forward context)" % layer.layer_name)
        return l2p

    # -- forward ----------------------------------------------------------------
    def routing(self, layer, topk_weights, topk_ids):
        """(logical ids, weights, any_empty, compute)."""
        np = pc._np()
        p = self.moe.moe_parallel_config
        use_ep = bool(p.use_ep)
        info = self.experts.info()
        n_physical = getattr(layer, "global_num_experts", info.n_experts)
        n_logical = getattr(self.moe, "num_logical_experts", None) or n_physical
        layer_id = self.layer_id(layer)
        if layer_id not in self._checked:
            self.experts.check_layer(layer_id, n_logical)
            self._checked.add(layer_id)
        # EPLB: re-read on every call (rearranged in place between steps)
        l2p = self.eplb_map(layer) if p.enable_eplb else None
        expert_map = getattr(layer, "expert_map", None) if use_ep else None
        if self.experts.on_device(topk_ids):  # MOED_ZERO_COPY=doorbell
            dev = topk_ids.device
            if l2p is None:
                table = pc.id_table(n_physical, info.n_experts)
                if expert_map is not None:
                    table = np.where(pc.to_numpy(expert_map, np.int64) >= 0, table,
                                     -1).astype(np.int32)
                table_dev = pc.device_table(table, dev)
            else:
                import torch
                t = pc.device_p2l(l2p.to(dev), n_physical)
                if expert_map is not None:
                    t = torch.where(expert_map.to(dev) >= 0, t, torch.full_like(t, -1))
                table_dev = t.to(torch.int32)
            ids, w = pc.device_routing(topk_ids, topk_weights, table_dev, info.n_experts)
            any_empty = True
        else:
            p2l = None if l2p is None else pc.p2l_from_l2p(l2p, n_physical)
            table = pc.id_table(n_physical, info.n_experts, p2l=p2l)
            if expert_map is not None:
                local = pc.to_numpy(expert_map, np.int64) >= 0
                table = np.where(local, table, -1).astype(np.int32)
            ids, any_empty = pc.map_ids(topk_ids, table)
            w = pc.to_numpy(topk_weights, np.float32)
        compute, _ = pc.rank_role(p.tp_rank, p.ep_rank, framework_serves_shared=True)
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
