/* config_keys.c - the one table of moed's config keys (config_int.h): each
 * row is a key's dotted path, type, bounds, default (as text), its field in
 * struct moed_cfg and its doc. config.c walks it for defaults, validation,
 * the effective-config JSON and the Markdown reference (config/README.md).
 */
#include "config_int.h"


const char *const cfg_backend_names[] = {"auto", "cuda", "cpu", NULL};
const char *const cfg_loglevel_names[] = {"error", "warn", "info", "debug", NULL};

/* The one table. Keep keys of a section together and sections in this order:
 * the effective-config JSON and the reference follow the table order. */
const struct cfg_key cfg_keys[] = {
    /* server */
    {.path = "server.socket", .type = T_PATH, .min = 1, .max = MOED_SOCKET_PATH_MAX,
     .def = "/tmp/moed.sock", FIELD(socket_path),
     .too_long = "a Unix socket path may be at most 107 bytes",
     .doc = "Unix socket the daemon listens on (created at start, removed at exit); a "
            "relative path is relative to the daemon's working directory."},
    {.path = "server.socket_mode", .type = T_MODE, .min = 0, .max = 0777, .def = "0660",
     FIELD(socket_mode),
     .doc = "File mode of the socket, an octal string; connecting needs write permission."},
    {.path = "server.socket_group", .type = T_STRING, .min = 0, .max = 63, .def = "",
     FIELD(socket_group),
     .doc = "Group name given to the socket file; empty leaves the daemon's group."},
    {.path = "server.allowed_uids", .type = T_UINT_ARRAY, .min = 0, .max = 4294967294LL,
     .def = "[]", FIELD(allowed_uids), COUNT(n_allowed_uids),
     .doc = "Peer uids allowed to connect (checked with SO_PEERCRED), in addition to the "
            "daemon's own uid and root, which are always allowed."},
    {.path = "server.allowed_gids", .type = T_UINT_ARRAY, .min = 0, .max = 4294967294LL,
     .def = "[]", FIELD(allowed_gids), COUNT(n_allowed_gids),
     .doc = "Peer primary gids allowed to connect, in addition to allowed_uids."},
    {.path = "server.max_clients", .type = T_UINT, .min = 1, .max = 4096, .def = "64",
     FIELD(max_clients),
     .doc = "Connections served at once; further connections get a busy error and are closed."},
    {.path = "server.max_pending_per_client", .type = T_UINT, .min = 1, .max = 4096,
     .def = "64", FIELD(max_pending_per_client),
     .doc = "Requests one client may have in flight, of every kind (FORWARD, STATUS, PING, "
            "HELLO), counted until the reply is written to its socket; over it the daemon "
            "stops reading that client until replies drain (back-pressure)."},
    {.path = "server.max_frame_bytes", .type = T_UINT, .min = 65536, .max = 4294967296LL,
     .def = "67108864", FIELD(max_frame_bytes), .bytes = true,
     .doc = "Largest request payload accepted; a larger frame is answered with a too-big "
            "error and the connection is closed."},
    {.path = "server.max_client_buffer_bytes", .type = T_UINT, .min = 65536,
     .max = 68719476736LL, .def = "268435456", FIELD(max_client_buffer_bytes), .bytes = true,
     .allowed = "at least server.max_frame_bytes",
     .doc = "Reply memory queued for one client (frames plus their allocation overhead) "
            "before the daemon stops reading its requests (back-pressure for a slow reader); "
            "a client that does not read them within server.frame_timeout_ms is "
            "disconnected."},
    {.path = "server.frame_timeout_ms", .type = T_UINT, .min = 1, .max = 600000,
     .def = "5000", FIELD(frame_timeout_ms),
     .doc = "Once a frame's first byte has arrived, the whole frame must arrive within this "
            "many milliseconds or the client gets a timeout error and is closed."},
    {.path = "server.read_buffer_keep_bytes", .type = T_UINT, .min = 0, .max = 4294967296LL,
     .def = "8388608", FIELD(read_buffer_keep_bytes), .bytes = true,
     .doc = "A connection keeps its read buffer between frames as long as it is at most this "
            "big, so the next frame of a steady client is read without allocating; a buffer "
            "grown beyond it for a bigger frame is freed once the connection is idle (0: "
            "always freed). Also the largest ordinary buffer kept as one of the 16 spares that "
            "read buffers, reply frames and batches are taken from (a connection reads into one "
            "while the engine works on its last frame in place), so the worst case is "
            "max_clients + 16 times this, besides server.pinned_pool_bytes."},
    {.path = "server.socket_buffer_bytes", .type = T_UINT, .min = 0, .max = 1073741824,
     .def = "1048576", FIELD(socket_buffer_bytes), .bytes = true,
     .doc = "Kernel send buffer (SO_SNDBUF) asked for each client socket, so that a reply up "
            "to about this size is written in one system call instead of waiting for the "
            "client to read part of it; the kernel caps it at net.core.wmem_max (and doubles "
            "it for its own bookkeeping). 0 keeps the kernel default (about 208 KiB)."},
    {.path = "server.pinned_pool_bytes", .type = T_UINT, .min = 0, .max = 68719476736LL,
     .def = "268435456", FIELD(pinned_pool_bytes), .bytes = true,
     .doc = "Most host memory taken from the backend's own allocator (CUDA: pinned, "
            "device-mapped) for read buffers, reply frames and batches, so that the GPU reads x "
            "and writes y where they lie instead of through copies. Taken as needed in "
            "power-of-two buffers from 64 KiB and kept for reuse until the daemon stops "
            "(freeing pinned memory waits for the resident kernel to exit); beyond it, buffers "
            "are ordinary memory and go through the backend's staging copies. 0: never. No "
            "effect on a backend without such an allocator (CPU)."},
    {.path = "server.max_registered_buffers", .type = T_UINT, .min = 0, .max = 4096,
     .def = "64", FIELD(max_registered_buffers),
     .doc = "Client GPU buffers (CUDA IPC, protocol version 2 REGISTER_BUF) one connection may "
            "have registered at once; one more is refused with a busy error. Each is mapped "
            "into the daemon once and stays mapped until it is unregistered, or its client "
            "disconnects, and the last request using it has completed. 0: registration off."},
    {.path = "server.max_channels_per_client", .type = T_UINT, .min = 1, .max = 16,
     .def = "4", FIELD(max_channels_per_client),
     .doc = "GPU doorbell channels one connection may have open at once (CHAN_OPEN past it: "
            "MOED_E_BUSY), so that one client cannot take every entry of engine.max_channels; "
            "a serving engine needs one per process and GPU stream."},
    {.path = "server.idle_timeout_ms", .type = T_UINT, .min = 0, .max = 86400000, .def = "0",
     FIELD(idle_timeout_ms),
     .doc = "A client with nothing in progress (no partial frame, no request unanswered, no "
            "doorbell channel open: its client submits on the GPU, not on the socket) for "
            "this many milliseconds gets a timeout error and is closed, so idle connections "
            "cannot hold every server.max_clients slot. 0 (the default): never, because an "
            "LLM server keeps one connection per worker open through quiet hours; set it when "
            "clients reconnect on their own."},
    {.path = "server.max_reply_bytes", .type = T_UINT, .min = 65536, .max = 1099511627776LL,
     .def = "1073741824", FIELD(max_reply_bytes), .bytes = true,
     .doc = "Memory that queued replies (frames and their bookkeeping) may hold for all "
            "clients together; past it the client holding the most is disconnected. Each "
            "client is also held to server.max_client_buffer_bytes (to this, if smaller)."},
    /* status */
    {.path = "status.address", .type = T_STRING, .min = 1, .max = 15, .def = "127.0.0.1",
     FIELD(status_addr), .check = cfg_check_ipv4, .allowed = "an IPv4 literal",
     .doc = "Address of the HTTP status server (/status, /metrics, /healthz); keep it on "
            "loopback unless the port is firewalled."},
    {.path = "status.port", .type = T_UINT, .min = 0, .max = 65535, .def = "9464",
     FIELD(status_port), .doc = "TCP port of the HTTP status server; 0 turns it off."},
    {.path = "status.header_timeout_ms", .type = T_UINT, .min = 100, .max = 60000,
     .def = "2000", FIELD(status_header_timeout_ms),
     .doc = "A status connection must send its whole request head within this many "
            "milliseconds of connecting, or it is answered 408 and closed, so a slow sender "
            "(slowloris) holds one of the 64 connection slots only this long."},
    {.path = "status.max_conns_per_addr", .type = T_UINT, .min = 1, .max = 64, .def = "16",
     FIELD(status_max_conns_per_addr),
     .doc = "Status connections one client address may hold of the 64 served at once; more "
            "are answered 503. When all 64 are taken, a client from an address holding fewer "
            "takes the slot of the oldest unfinished request of the address holding the most, "
            "so one address's slow connections cannot keep probes and scrapes from others "
            "out. Every refusal is an answer followed by a clean close (no reset)."},
    /* model */
    {.path = "model.path", .type = T_PATH, .min = 1, .max = MOED_CFG_PATH_MAX - 1,
     .def = "synthetic:tiny", FIELD(model), .check = cfg_check_model,
     .allowed = "a directory, or synthetic:PRESET[:layers=N][:seed=S] with N in 1 .. 1024",
     .doc = "NVFP4 checkpoint directory (ModelOpt layout), or a synthetic model generated "
            "on first use into model.synthetic_dir. The checkpoint's hidden_size and "
            "moe_intermediate_size must be multiples of 16 (whole E4M3 scale blocks; enough "
            "for the CPU backend); the CUDA backend needs multiples of 64 (its kernel streams "
            "K in 64-weight units). A NaN block scale (E4M3 0x7f or 0xff) is refused at "
            "load (exit code 3)."},
    {.path = "model.synthetic_dir", .type = T_PATH, .min = 1, .max = MOED_CFG_PATH_MAX - 1,
     .def = "/tmp/moed-models", FIELD(synthetic_dir),
     .doc = "Directory where synthetic models are generated and reused."},
    /* engine */
    {.path = "engine.backend", .type = T_ENUM, .def = "auto", FIELD(backend),
     .names = cfg_backend_names,
     .doc = "auto: CUDA when this build has it and a GPU is visible, else the CPU reference."},
    {.path = "engine.gpus", .type = T_INT_ARRAY, .min = 0, .max = 1023, .def = "[]",
     FIELD(gpus), COUNT(n_gpus), .repeats = true,
     .doc = "CUDA device ordinals to hold experts on; empty: GPU 0. More than one (up to 8): "
            "expert parallelism (docs/MULTI_GPU.md), one persistent kernel per entry, device "
            "i of engine.placement on entry i, the rows combined on the first; every GPU must "
            "reach the first's memory (peer access). A GPU listed more than once (e.g. [0, "
            "0]: expert parallelism on one GPU, for tests) holds one device per entry, each "
            "kernel on an equal share of the GPU's SMs (the SMs engine.sms_free leaves, "
            "divided by the entries naming it: persistent kernels that did not all fit at "
            "once would deadlock)."},
    {.path = "engine.placement", .type = T_PATH, .min = 0, .max = MOED_CFG_PATH_MAX - 1,
     .def = "", FIELD(placement),
     .doc = "With more than one engine.gpus entry: which device holds which routed experts "
            "of each MoE layer. \"\": balanced by expert count (moed_placement_balanced, "
            "no replicas); else the path of a map `moectl placement --json` wrote "
            "(docs/MULTI_GPU.md): its gpus must equal the engine.gpus entries and its "
            "n_experts and n_shared the model's, with every MoE layer listed once; any "
            "error names the file, the layer and the entry. Shared experts are on every "
            "device."},
    {.path = "engine.sms_free", .type = T_UINT, .min = 0, .max = 255, .def = "0",
     FIELD(sms_free),
     .doc = "SMs per GPU left free of the persistent kernel (for NCCL or a co-located "
            "server). 0 under MPS means engine.mps_sms_free_percent of them. Under MPS with "
            "SMs left free, moed's CUDA context is limited to the others (MPS execution "
            "affinity), so that its CTAs leave the free SMs whole; one moed serves a GPU "
            "under MPS (a second is refused at start: docs/ZERO_COPY.md)."},
    {.path = "engine.mps_sms_free_percent", .type = T_UINT, .min = 0, .max = 90, .def = "50",
     FIELD(mps_sms_free_percent),
     .doc = "When the GPU runs under MPS (other processes' kernels share it, e.g. a serving "
            "engine that lends moed its buffers: docs/ZERO_COPY.md) and engine.sms_free is 0: "
            "the percent of the GPU's SMs the persistent kernel leaves free, so that the "
            "engine's kernels always find room (with every SM taken they wait for moed's "
            "kernel to idle out). 0: every SM, as without MPS."},
    {.path = "engine.nccl_ranks", .type = T_UINT, .min = 1, .max = 8, .def = "1",
     FIELD(nccl_ranks),
     .doc = "Daemons (ranks) of one expert-parallel NCCL group, one GPU each, on one host or "
            "several (docs/MULTI_GPU.md, \"Across hosts\": built, its exchanges do not "
            "complete on a GPU yet); 1: no group. Rank 0 serves the "
            "clients and computes the experts engine.placement puts on device 0; rank r > 0 "
            "computes device r's for rank 0 and refuses client batches. Needs engine.backend "
            "\"cuda\", at most one engine.gpus entry and engine.sms_free >= 2 (NCCL's kernels "
            "run beside the persistent one). Every rank must load the same model."},
    {.path = "engine.nccl_rank", .type = T_UINT, .min = 0, .max = 7, .def = "0",
     FIELD(nccl_rank),
     .doc = "This daemon's rank in the NCCL group, below engine.nccl_ranks."},
    {.path = "engine.nccl_id_file", .type = T_PATH, .min = 0, .max = MOED_CFG_PATH_MAX - 1,
     .def = "", FIELD(nccl_id_file),
     .doc = "The group's unique id (ncclGetUniqueId): rank 0 writes it there at start (256 "
            "hex digits, mode 0600, replaced atomically; removed at exit), the other ranks "
            "wait for it up to engine.nccl_timeout_ms, so the file must be one they all "
            "read (a shared directory across hosts). \"\": NCCL's own bootstrap from the "
            "environment instead: every rank started with the same NCCL_COMM_ID=host:port, "
            "rank 0 listening there."},
    {.path = "engine.nccl_timeout_ms", .type = T_UINT, .min = 100, .max = 3600000,
     .def = "60000", FIELD(nccl_timeout_ms),
     .doc = "The group must form within this many milliseconds of start, every exchange "
            "with a peer must finish within it, and a worker that hears nothing from rank 0 "
            "for this long gives up; then the communicator is aborted, the daemon is no "
            "longer ready and exits with code 4."},
    {.path = "engine.nccl_keepalive_ms", .type = T_UINT, .min = 10, .max = 600000,
     .def = "1000", FIELD(nccl_keepalive_ms),
     .allowed = "less than engine.nccl_timeout_ms",
     .doc = "Rank 0 pings every peer that has had no batch for this many milliseconds, so "
            "that either side notices the other's loss within engine.nccl_timeout_ms."},
    {.path = "engine.max_tokens", .type = T_UINT, .min = 1, .max = 16384, .def = "512",
     FIELD(max_tokens),
     .doc = "Most tokens in one batch (and in one request; the clients split a larger one "
            "into pipelined requests). server.max_frame_bytes must hold a request of this "
            "many tokens. Memory: the CPU backend computes at most 1024 tokens at a time; "
            "the CUDA backend reserves device scratch for max_tokens at "
            "start (about max_tokens * (k + S) * (2I + 4H) bytes: 1.1 GiB at 4096 tokens of "
            "a DeepSeek-V3 layer) and needs max_tokens * (k + S) <= 65535 (its routing "
            "tables are 16-bit)."},
    {.path = "engine.cpu_threads", .type = T_UINT, .min = 0, .max = 1024, .def = "0",
     FIELD(cpu_threads), .doc = "Threads of the CPU backend; 0: one per core."},
    {.path = "engine.batch_deadline_ms", .type = T_UINT, .min = 1, .max = 600000,
     .def = "10000", FIELD(batch_deadline_ms),
     .doc = "A batch not finished within this many milliseconds fails with a timeout and "
            "marks the backend unhealthy."},
    {.path = "engine.idle_exit_ms", .type = T_UINT, .min = 0, .max = 86400000, .def = "0",
     FIELD(idle_exit_ms),
     .doc = "Idle milliseconds after which the persistent kernel exits, to be relaunched "
            "by the next batch; 0: never."},
    {.path = "engine.loop_spin_us", .type = T_UINT, .min = 0, .max = 1000000, .def = "1000",
     FIELD(loop_spin_us),
     .doc = "CUDA backend: while a batch is on the GPU, and for this many microseconds after "
            "the last one came back, the daemon's event loop polls without sleeping (one CPU "
            "core busy), so that a reply leaves as soon as the kernel is done and the next "
            "request is read at once; a loop asleep through a batch wakes up tens of "
            "microseconds late (bench/NOTES.md). 0: the loop sleeps between events. The CPU "
            "backend's batches take milliseconds and its threads need the cores: it never "
            "spins."},
    {.path = "engine.max_channels", .type = T_UINT, .min = 0, .max = 16, .def = "8",
     FIELD(max_channels),
     .doc = "GPU doorbell channels (ipc/PROTOCOL.md section 10: a client's kernel, in a CUDA "
            "graph, submits layers through device memory the persistent kernel polls) open "
            "at once, over all connections; a closed channel counts until the kernel has let "
            "go of it. At most 16 (the kernel's table). CUDA backend only; 0 turns channels "
            "off (CHAN_OPEN is answered MOED_E_UNSUPPORTED)."},
    {.path = "engine.drain_stall_ms", .type = T_UINT, .min = 1, .max = 600000, .def = "10000",
     FIELD(drain_stall_ms),
     .doc = "On SIGTERM the daemon answers every request it took before it exits; it gives up "
            "(exit 4, the rest unanswered) only when no batch has completed for "
            "engine.batch_deadline_ms plus this many milliseconds (a hung backend). Every "
            "completed batch restarts the wait, so a long queue drains completely."},
    /* log */
    {.path = "log.level", .type = T_LOGLEVEL, .def = "info", FIELD(log_level),
     .names = cfg_loglevel_names, .doc = "Lines above this level are not written to stderr."},
};
const size_t cfg_n_keys = sizeof cfg_keys / sizeof cfg_keys[0];
_Static_assert(sizeof cfg_keys / sizeof cfg_keys[0] <= CFG_KEYS_MAX, "raise CFG_KEYS_MAX");

const char *const cfg_sections[N_SECTIONS] = {"server", "status", "model", "engine", "log"};
