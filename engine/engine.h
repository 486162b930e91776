/* engine.h - moed's request engine (prefix moed_engine_).
 *
 * The engine owns the model, the compute backend and struct moed_stats. It
 * takes FORWARD requests from the server (moed_engine_server_ops), validates
 * them, merges waiting requests of one layer into batches of up to max_tokens
 * tokens, keeps at most MOED_ENGINE_MAX_OUTSTANDING batches at the backend
 * (so requests merge while the backend is busy), and answers each request
 * with its slice of the batch output.
 *
 * The backend calls done() on its own thread; the engine pushes the batch to
 * a mutex-protected completion list and wakes the loop with uv_async_send;
 * the async callback drains the whole list (sends coalesce).
 *
 * Everything except the backend's done() runs on the loop thread.
 */
#ifndef MOED_ENGINE_H
#define MOED_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "backend.h"
#include "config.h"
#include "model.h"
#include "server.h"
#include "stats.h"

#define MOED_ENGINE_MAX_OUTSTANDING 2 /* batches at the backend at once */

struct moed_engine;

/* Open the engine on `model` (ownership moves to the engine, also on
 * failure) with the backend cfg->backend names ("auto": CUDA if available,
 * else CPU; "cuda" without a GPU fails with MOED_E_BACKEND). Makes no libuv
 * call, so it may run while another thread runs `loop` (the start-up status
 * thread); `progress` (may be NULL) sees weight placement. Then call
 * moed_engine_attach on the loop's thread before anything else. */
int moed_engine_open(uv_loop_t *loop, struct moed_model *model, const struct moed_cfg *cfg,
                     moed_progress_fn progress, void *progress_ctx, struct moed_engine **out,
                     char *err, size_t errlen);

/* Register the engine's handles (completion wake-up, health timer) on its
 * loop; from the loop's thread. The loop must run to deliver completions. */
int moed_engine_attach(struct moed_engine *e, char *err, size_t errlen);

/* Run one small deterministic batch through the backend (running the loop
 * until it completes) and compare it with moe_ref_forward on the same input;
 * fails with MOED_E_BACKEND if the relative L2 error is over 1e-2. On
 * success marks the engine loaded (stats.loaded = 1). */
int moed_engine_self_check(struct moed_engine *e, char *err, size_t errlen);

/* The server callbacks; ctx is the engine. */
const struct moed_server_ops *moed_engine_server_ops(void);

/* The server whose counters (clients, error replies) the stats show; NULL
 * before it opens and once it is closed. */
void moed_engine_set_server(struct moed_engine *e, const struct moed_server *srv);

/* The buffer pool the server must read into and write from (its buffers may
 * be the backend's pinned host memory). Owned by the engine; the server must
 * be closed before the engine. */
struct moed_bufpool *moed_engine_bufpool(struct moed_engine *e);

/* The stats, brought up to date (busy time, backend health) for rendering.
 * Owned by the engine; valid until moed_engine_close. */
struct moed_stats *moed_engine_stats(struct moed_engine *e);

/* Called on the loop thread when the backend fails (sticky device error or
 * stalled kernel): the engine has already failed every request in flight. */
void moed_engine_on_failure(struct moed_engine *e, void (*cb)(void *arg), void *arg);

/* Stop taking FORWARD requests (new ones get MOED_E_SHUTDOWN), let every
 * request in flight finish and be answered, then call done(arg) (at once if
 * nothing is in flight). Until then progress(arg) (may be NULL) is called
 * after each loop pass that completed batches, so that the caller's drain
 * deadline can follow progress instead of the clock. */
void moed_engine_drain(struct moed_engine *e, void (*done)(void *arg), void (*progress)(void *arg),
                       void *arg);

/* 1 once the backend has failed. */
int moed_engine_failed(const struct moed_engine *e);

/* Close the backend (it finishes what is queued), the buffer pool, the model
 * and the async handle; the server must be closed already. Run the loop
 * afterwards so the handle's close completes; the engine's memory is freed in
 * that close callback. */
void moed_engine_close(struct moed_engine *e);

#endif
