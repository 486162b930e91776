# Type stubs of the public API of moed_client (the module itself is plain
# Python 3.9+ with no annotations, so that it imports without typing extras).
# Arrays are numpy arrays, torch tensors or (hidden states) bytes-like
# objects; the result of forward() has the kind of its hidden_states.
from typing import Any, Dict, Optional, Sequence, Tuple

__version__: str
DEFAULT_SOCKET: str
ERROR_NAMES: Dict[int, str]
PROTO_MIN_VERSION: int
FORWARD_ROUTED_ONLY: int
FORWARD_EMPTY_SLOTS: int
DESC_TIMES: int
EXPERT_NONE: int

class MoedError(Exception):
    code: int
    name: str
    message: str
    request_id: Optional[int]
    def __init__(self, code: int, message: str, request_id: Optional[int] = ...) -> None: ...

class Hello:
    version: int
    hidden: int
    inter: int
    n_experts: int
    top_k: int
    n_shared: int
    n_layers: int
    first_moe_layer: int
    max_tokens: int
    max_frame_bytes: int
    backend: str
    moe_layers: Tuple[int, ...]
    def __init__(self, **kw: Any) -> None: ...
    def as_dict(self) -> Dict[str, Any]: ...

def encode_frame(msg_type: int, request_id: int, payload: bytes = ...) -> bytes: ...
def decode_header(buf: bytes, max_payload: Optional[int] = ...) -> Tuple[int, int, int]: ...
def encode_forward(layer: int, x_raw: bytes, n_tokens: int, ids_raw: bytes, w_raw: bytes,
                   top_k: int, flags: int = ...) -> bytes: ...

class Client:
    path: str
    timeout: Optional[float]
    info: Optional[Hello]
    max_inflight: int
    spin_s: float
    def __init__(self, path: Optional[str] = ..., timeout: Optional[float] = ...,
                 sock: Any = ..., max_inflight: int = ..., spin_us: int = ...) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, *exc: Any) -> None: ...
    def close(self) -> None: ...
    @property
    def inflight(self) -> int: ...
    def hello(self) -> Hello: ...
    def status(self) -> Dict[str, Any]: ...
    def ping(self, payload: Optional[bytes] = ...) -> float: ...
    def forward(self, layer: int, hidden_states: Any, topk_ids: Any, topk_weights: Any, *,
                routed_only: bool = ..., empty_slots: bool = ...) -> Any: ...
    def send_forward(self, request_id: int, layer: int, hidden_states: Any, topk_ids: Any,
                     topk_weights: Any, *, routed_only: bool = ...,
                     empty_slots: bool = ...) -> None: ...
    def recv(self) -> Tuple[int, Any]: ...
    def register_buf(self, handle: bytes, offset: int, size: int, uuid: bytes) -> int: ...
    def unregister_buf(self, buf_id: int) -> None: ...
    desc_stamps: Optional[Tuple[int, int]]
    def forward_desc(self, layer: int, n_tokens: int, x: Tuple[int, int], ids: Tuple[int, int],
                     w: Tuple[int, int], y: Tuple[int, int],
                     top_k: Optional[int] = ...,
                     times: bool = ...) -> Optional[Tuple[int, int, int, int]]: ...
    def chan_open(self, buf_ids: Sequence[int], uuid: bytes) -> "ChanInfo": ...
    def chan_close(self, chan_id: int) -> None: ...

def fused_experts(hidden_states: Any, topk_weights: Any, topk_ids: Any, layer: int,
                  client: Optional[Client] = ..., *, routed_only: bool = ...,
                  empty_slots: bool = ...) -> Any: ...

class ChanInfo:
    chan_id: int
    slots: int
    key: int
    handle: bytes
    size: int
    abi_version: int
    kernel: bytes
    def __init__(self, **kw: Any) -> None: ...
