"""What the SGLang and vLLM plugins share: the switch, the expert-id maps,
the rank roles, the routed scaling and the call into moed.

No framework is imported here (the unit tests in tests/py/test_plugin_logic.py
run it with numpy against a real daemon); torch is used only when the caller
passes torch tensors. The framework-specific parts are sglang_plugin.py and
vllm_plugin.py.

Terms: a *physical* expert id is the id the framework's router writes into
topk_ids (with EPLB it can be >= the model's expert count: redundant copies);
the *logical* id is the checkpoint's expert index, the one moed knows; an
*incoming* id is what this rank's apply() actually receives (with SGLang's
expert parallelism the dispatcher has already turned global ids into this
rank's local ids, -1 for experts of other ranks). A table of int32 maps every
incoming id to its logical id or -1 (nothing to compute here).
"""

import inspect
import os

import moed_client
from moed_client._arrays import _is_torch

ENV_SOCKET = "MOED_SOCKET"
ENV_PLUGIN = "MOED_PLUGIN"
ENV_ZERO_COPY = "MOED_ZERO_COPY"


class MoedPluginError(RuntimeError):
    """A configuration the plugin cannot serve correctly (raised, never
    silently approximated)."""


def enabled(environ=None):
    """The plugins act only when MOED_SOCKET names the daemon's socket.
    MOED_PLUGIN=0 switches them off with the socket still set (for
    comparison runs); any other MOED_PLUGIN value changes nothing."""
    env = os.environ if environ is None else environ
    if env.get(ENV_PLUGIN, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return bool(env.get(ENV_SOCKET, "").strip())


def zero_copy(environ=None):
    """MOED_ZERO_COPY=doorbell: a layer whose tensors are on a CUDA device
    goes to moed through a GPU doorbell channel (moed_client.cuda.
    DoorbellSession): no host copy, no host round trip, and legal inside the
    framework's CUDA graph. It needs moed on the same GPU under MPS (or a
    peer GPU) and a daemon with the CUDA backend (docs/ZERO_COPY.md).
    Unset, empty or off: the socket path. Returns "doorbell" or None."""
    env = os.environ if environ is None else environ
    v = env.get(ENV_ZERO_COPY, "").strip().lower()
    if v in ("", "0", "off", "false", "no"):
        return None
    if v == "doorbell":
        return v
    raise MoedPluginError("%s=%r: expected doorbell or off" % (ENV_ZERO_COPY, v))


# Parameter names the frameworks' loaders map ModelOpt NVFP4 expert tensors
# to (weight, weight_scale, weight_scale_2, input_scale of gate/up -> w13 and
# down -> w2): the names ModelOptNvFp4FusedMoEMethod.create_weights (SGLang)
# and ModelOptNvFp4FusedMoE.create_weights (vLLM) register.
EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
                 "w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale")


def skip_expert_tensor(param, loaded_weight, *args, **kwargs):
    """weight_loader of the placeholders: the checkpoint's expert tensor is
    dropped (moed holds the experts). Returns True for loaders that ask
    return_success (vLLM's RoutedExperts.load_weights)."""
    return True


def add_placeholders(layer, num_experts, row_bytes=0):
    """Register EXPERT_PARAMS on the layer as [num_experts, row_bytes] uint8
    parameters (zero bytes by default, yet one row per expert for code that
    walks the expert dimension) whose loader drops the checkpoint's tensors.
    row_bytes 1 where vLLM's EPLB views each as [local experts, -1]
    (RoutedExperts.get_expert_weights: a view with -1 of a tensor with no
    element is refused), a row it then moves between ranks with the experts."""
    import torch
    for name in EXPERT_PARAMS:
        p = torch.nn.Parameter(torch.zeros(num_experts, row_bytes, dtype=torch.uint8),
                               requires_grad=False)
        p.weight_loader = skip_expert_tensor
        p.moed_row_bytes = row_bytes
        layer.register_parameter(name, p)


def check_placeholders(layer):
    """After loading: nothing was loaded, nothing is to be repacked."""
    for name in EXPERT_PARAMS:
        p = getattr(layer, name)
        if p.dim() != 2 or p.numel() != p.shape[0] * getattr(p, "moed_row_bytes", 0):
            raise MoedPluginError("expert parameter %s of a moed-served layer holds data"
                                  % name)


def _np():
    import numpy
    return numpy


def to_numpy(a, dtype):
    """A host numpy copy of a torch tensor / numpy array / nested list."""
    np = _np()
    if _is_torch(a):
        a = a.detach().to("cpu")
        if a.is_floating_point():
            a = a.float()
        a = a.numpy()
    return np.asarray(a, dtype=dtype)


def id_table(n_incoming, n_logical, *, n_routed_incoming=None, offset=0, p2l=None):
    """int32 table [n_incoming]: incoming id -> logical expert id or -1.

    Incoming ids 0 .. n_routed_incoming-1 are the physical experts offset ..
    offset+n_routed_incoming-1 (offset: the first physical expert of this
    rank under expert parallelism, 0 otherwise); ids from n_routed_incoming
    on are the framework's fused shared-expert slots, -1 here (moed adds the
    shared experts itself, see rank_role). p2l: physical -> logical
    (EPLB's physical_to_logical map; None: the identity, which needs no
    redundant experts; -1 in it: a physical slot that holds no expert, -1
    here too). Every logical id must be < n_logical."""
    np = _np()
    n_routed = n_incoming if n_routed_incoming is None else n_routed_incoming
    if not 0 <= n_routed <= n_incoming:
        raise ValueError("n_routed_incoming %d is outside [0, %d]" % (n_routed, n_incoming))
    phys = np.arange(offset, offset + n_routed, dtype=np.int64)
    if p2l is None:
        logical = phys
    else:
        p2l = to_numpy(p2l, np.int64).reshape(-1)
        if n_routed and phys[-1] >= p2l.shape[0]:
            raise MoedPluginError("physical expert %d is outside the EPLB map of %d experts"
                                  % (phys[-1], p2l.shape[0]))
        logical = p2l[phys]
    used = logical[logical >= 0] if p2l is not None else logical
    if n_routed and used.size and (used.min() < 0 or used.max() >= n_logical):
        raise MoedPluginError(
            "physical experts %d..%d map to logical ids %d..%d, outside the daemon's %d experts "
            "(redundant EPLB experts need the physical->logical map)"
            % (offset, offset + n_routed - 1, used.min(), used.max(), n_logical))
    table = np.full(n_incoming, -1, dtype=np.int32)
    table[:n_routed] = logical
    return table


def p2l_from_l2p(logical_to_physical, n_physical):
    """Invert an EPLB logical->physical map ([n_logical, max_replicas], -1
    padded) into physical -> logical ([n_physical], -1 where unused)."""
    np = _np()
    l2p = to_numpy(logical_to_physical, np.int64)
    if l2p.ndim != 2:
        raise MoedPluginError("EPLB logical->physical map must be 2-D, got shape %s"
                              % (l2p.shape,))
    logical = np.repeat(np.arange(l2p.shape[0], dtype=np.int64), l2p.shape[1])
    phys = l2p.reshape(-1)
    used = phys >= 0
    if (phys[used] >= n_physical).any():
        raise MoedPluginError("EPLB map names physical expert %d of %d"
                              % (int(phys[used].max()), n_physical))
    out = np.full(n_physical, -1, dtype=np.int64)
    out[phys[used]] = logical[used]
    return out


def device_p2l(logical_to_physical, n_physical):
    """p2l_from_l2p with torch ops on the map's own device and no host
    synchronization (the doorbell path, captured in CUDA graphs): int64
    [n_physical], -1 where no logical expert is placed."""
    import torch
    l2p = logical_to_physical.long()
    n_log, slots = l2p.shape
    logical = torch.arange(n_log, device=l2p.device).repeat_interleave(slots)
    phys = l2p.reshape(-1)
    # unused slots (-1) write into one extra element that is cut off
    idx = torch.where((phys >= 0) & (phys < n_physical), phys, torch.full_like(phys, n_physical))
    out = torch.full((n_physical + 1,), -1, dtype=torch.long, device=l2p.device)
    out.scatter_(0, idx, torch.where(phys >= 0, logical, torch.full_like(logical, -1)))
    return out[:n_physical]


def map_ids(topk_ids, table):
    """(logical ids int32 [T, k] with -1 for empty slots, any_empty)."""
    np = _np()
    ids = to_numpy(topk_ids, np.int64)
    if ids.ndim != 2:
        raise ValueError("topk_ids must be 2-D [T, k], got shape %s" % (ids.shape,))
    bad = (ids >= table.shape[0]) | (ids < -1)
    if bad.any():
        raise MoedPluginError("topk id %d is outside the %d ids this rank can receive"
                              % (int(ids[bad][0]), table.shape[0]))
    out = np.where(ids < 0, -1, table[np.clip(ids, 0, None)]).astype(np.int32)
    return out, bool((out < 0).any())


def drop_shared_columns(topk_ids, topk_weights, n_cols, n_routed_incoming):
    """Drop the framework's fused shared-expert columns (the last n_cols of
    top-k, SGLang's num_fused_shared_experts slots): moed adds the shared
    experts itself, with weight 1, as the model defines them. Refuses a
    batch whose dropped columns name routed experts (a layout this does not
    know)."""
    if not n_cols:
        return topk_ids, topk_weights
    np = _np()
    ids = to_numpy(topk_ids, np.int64)
    tail = ids[:, -n_cols:]
    if ((tail >= 0) & (tail < n_routed_incoming)).any():
        raise MoedPluginError("the last %d top-k column(s) should be the fused shared "
                              "experts (ids >= %d), found a routed id" % (n_cols, n_routed_incoming))
    return ids[:, :-n_cols], to_numpy(topk_weights, np.float32)[:, :-n_cols]


def final_weights(topk_weights, routed_scaling_factor, fused_in_topk):
    """fp32 weights with the routed scaling applied exactly once: as they
    are when the framework already folded the factor into top-k
    (fused_in_topk), else multiplied by it here."""
    np = _np()
    w = to_numpy(topk_weights, np.float32)
    if not fused_in_topk and routed_scaling_factor not in (None, 1.0):
        w = w * np.float32(routed_scaling_factor)
    return w


def device_table(table, device, _cache={}):
    """id_table's table as an int32 tensor on `device`, made once per
    (table, device) (a host-to-device copy cannot be captured in a graph;
    the framework captures after its first calls)."""
    import torch
    key = (table.tobytes(), str(device))
    t = _cache.get(key)
    if t is None:
        if len(_cache) > 4096:
            _cache.clear()
        t = _cache[key] = torch.as_tensor(table, dtype=torch.int32).to(device)
    return t


def device_routing(topk_ids, topk_weights, table_dev, n_logical, *, n_shared_cols=0,
                   scale=None):
    """The doorbell path's routing, on the tensors' device and without a
    host synchronization (so that it can be captured in a CUDA graph):
    (ids int32 [T, k], weights fp32 [T, k]). The last n_shared_cols columns
    (the framework's fused shared-expert slots) are dropped; every id goes
    through table_dev (device_table); -1 stays an empty slot; an id the
    table does not cover (outside [-1, len(table))) becomes n_logical, which
    moed refuses (the call's error then surfaces in DoorbellSession.check())
    instead of being computed as some other expert. scale: the routed
    scaling factor to apply here (None: already applied, final_weights)."""
    import torch
    ids, w = topk_ids, topk_weights
    if n_shared_cols:
        ids, w = ids[:, :-n_shared_cols], w[:, :-n_shared_cols]
    ids = ids.long()
    n = table_dev.shape[0]
    inside = (ids >= 0) & (ids < n)
    mapped = table_dev[ids.clamp(0, max(n - 1, 0))].long()
    out = torch.where(inside, mapped,
                      torch.where(ids == -1, torch.full_like(ids, -1),
                                  torch.full_like(ids, n_logical)))
    w = w.float()
    if scale not in (None, 1.0):
        w = w * float(scale)
    return out.to(torch.int32), w


def rank_role(tp_rank, ep_rank, framework_serves_shared):
    """(compute, routed_only) for one rank.

    compute: this rank asks moed for its share. Under tensor parallelism
    every rank holds the same tokens and the framework all-reduces (sums)
    the ranks' outputs, so exactly one rank of the TP group (tp_rank 0)
    computes and the others return zeros (the pattern of SGLang's
    KTEPWrapperMethod, python/sglang/srt/layers/moe/kt_ep_wrapper.py). Under
    expert parallelism each EP rank computes its own experts (its table maps
    the others to -1) and the sum adds the ranks' shares.
    routed_only: moed leaves out its shared experts. It does when the
    framework computes them itself, and on every EP rank but the first, so
    that the shared term enters the sum once."""
    compute = tp_rank == 0
    return compute, bool(framework_serves_shared or ep_rank != 0)


def _zeros(x, t):
    if _is_torch(x):
        import torch
        return torch.zeros((t, x.shape[1]), dtype=x.dtype, device=x.device)
    np = _np()
    return np.zeros((t, x.shape[1]), dtype=x.dtype)


def _concat(parts):
    if _is_torch(parts[0]):
        import torch
        return torch.cat(parts, dim=0)
    return _np().concatenate(parts, axis=0)


def client_supports(client, keyword):
    """Whether this client's (or client class's) forward() takes the
    keyword (routed_only, empty_slots: protocol version 2 features)."""
    cls = client if isinstance(client, type) else type(client)
    try:
        return keyword in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


class Experts:
    """The plugin's side of moed: one client per thread (moed_client's
    default on $MOED_SOCKET), the daemon's dims cached, the flags checked
    against what the client can send."""

    def __init__(self, client=None, zero_copy_mode=None, sessions=None):
        self._client = client
        self.zero_copy = zero_copy_mode       # "doorbell" or None (zero_copy())
        self._sessions = {} if sessions is None else sessions  # device -> DoorbellSession

    def doorbell(self, device):
        """This process's doorbell session on `device` (made on first use: a
        doorbell channel with its arena in moed's memory;
        moed_client.cuda.DoorbellSession)."""
        key = str(device)
        s = self._sessions.get(key)
        if s is None:
            from moed_client import cuda as mcc
            s = self._sessions[key] = mcc.DoorbellSession(device=device)
        return s

    def on_device(self, x):
        """Whether x takes the doorbell path (zero-copy on and x on a GPU)."""
        return self.zero_copy == "doorbell" and _is_torch(x) and x.is_cuda

    @property
    def client(self):
        if self._client is not None:
            return self._client
        return moed_client._default_client()

    def info(self):
        c = self.client
        return c.info if c.info is not None else c.hello()

    def check_layer(self, layer_id, n_routed, top_k=None):
        """Refuse at once a layer whose shape the daemon does not serve."""
        info = self.info()
        moe_layers = getattr(info, "moe_layers", None)
        if moe_layers is None:
            moe_layers = range(info.first_moe_layer, info.n_layers)
        if layer_id not in moe_layers:
            raise MoedPluginError("layer %d is not an MoE layer of the daemon's model (MoE "
                                  "layers %s)" % (layer_id, _span(moe_layers)))
        if n_routed != info.n_experts:
            raise MoedPluginError("the framework's layer %d has %d routed experts, the "
                                  "daemon's model %d: not the same checkpoint"
                                  % (layer_id, n_routed, info.n_experts))
        return info

    def forward(self, layer_id, x, ids, w, *, routed_only, empty_slots):
        """y[T, H] (x's kind) for logical ids [T, k] (-1: empty slot) and
        final weights; T = 0 gives an empty [0, H] without a round trip,
        T over the daemon's max_tokens is sent in chunks (a client that
        splits by itself gets chunks it need not split)."""
        t = x.shape[0]
        if t == 0:
            return _zeros(x, 0)
        if self.on_device(x):
            return self._forward_doorbell(layer_id, x, ids, w, routed_only=routed_only)
        np = _np()
        c = self.client
        info = c.info if c.info is not None else c.hello()
        v2 = getattr(info, "version", 1) >= 2  # the daemon speaks the FORWARD flags
        if routed_only and info.n_shared:
            if not (v2 and client_supports(c, "routed_only")):
                raise MoedPluginError(
                    "the daemon adds %d shared expert(s) and the framework computes them too; "
                    "this moed_client or daemon cannot ask for the routed experts only "
                    "(protocol version 2, FORWARD flag routed_only)" % info.n_shared)
        kw = {}
        if routed_only and info.n_shared:
            kw["routed_only"] = True
        if empty_slots:
            if routed_only and bool((ids < 0).all()):
                return _zeros(x, t)  # nothing of this rank's in the batch
            if v2 and client_supports(c, "empty_slots"):
                kw["empty_slots"] = True
            else:
                # A version-1 client or daemon: an empty slot becomes expert 0 with
                # weight 0 (the same sum; the daemon computes one slot more).
                empty = ids < 0
                ids = np.where(empty, 0, ids).astype(np.int32)
                w = np.where(empty, np.float32(0), w).astype(np.float32)
        # a client that splits by itself pipelines the chunks: one call
        step = t if hasattr(c, "_forward_pipelined") else info.max_tokens
        parts = []
        for s in range(0, t, step):
            e = min(t, s + step)
            parts.append(c.forward(layer_id, x[s:e], ids[s:e], w[s:e], **kw))
        return parts[0] if len(parts) == 1 else _concat(parts)


    def _forward_doorbell(self, layer_id, x, ids, w, *, routed_only):
        """The doorbell path: ids and w from device_routing (on x's device),
        every call enqueued on the current stream; T over the session's
        max_tokens in chunks. Empty slots are always allowed (a -1 is one)."""
        s = self.doorbell(x.device)
        ro = bool(routed_only and s.info.n_shared)
        t, step = x.shape[0], s.max_tokens
        parts = [s.fused_experts(x[a:a + step], w[a:a + step], ids[a:a + step], layer_id,
                                 routed_only=ro, empty_slots=True)
                 for a in range(0, t, step)]
        return parts[0] if len(parts) == 1 else _concat(parts)


def _span(layers):
    layers = list(layers)
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return "%d..%d" % (layers[0], layers[-1])
    return ", ".join(str(l) for l in layers)
