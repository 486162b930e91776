"""GPU: a real transformers model whose MoE layers moed serves through the
doorbell, as the plugins do with MOED_ZERO_COPY=doorbell (moed_client.
_plugin_common.Experts' doorbell path: one DoorbellSession on the model's
GPU, T over max_tokens in chunks), on the daemon's GPU under MPS.

The model's own expert weights are the dequantized NVFP4 ones
(tests/py/test_e2e_transformers.py builds the checkpoint), so the model
computing its experts itself is the reference. Checked: prefill logits (40
tokens: chunks of max_tokens 16) within rel-L2 1e-2 and teacher-forced
greedy decoding agreeing in 31 of 32 steps; one MoE block (router top-k,
the arena copies and the doorbell kernel) captured in a CUDA graph and
replayed on new inputs gives the eager doorbell call's output bit for bit
and the model's own block within tolerance; no call refused (check()).
Run by scripts/run-gpu-tests.sh (step 7) under MPS; skips without torch,
transformers, a GPU or MPS.
"""

import faulthandler
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_util import du, torch  # noqa: E402

transformers = pytest.importorskip("transformers")

import moed_client as mc  # noqa: E402
import moed_client.cuda as mcc  # noqa: E402
from moed_client import _plugin_common as pc  # noqa: E402

import test_e2e_transformers as e2e  # noqa: E402  (tests/py, on gpu_util's path)

SMS_FREE = int(os.environ.get("MOED_TEST_SMS_FREE", "64"))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_model_served_through_the_doorbell(tmp_path, family):
    torch.manual_seed(7)
    cfg = e2e.CONFIGS[family]()
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ckpt = str(tmp_path / "ckpt")
    e2e.write_checkpoint(model, ckpt)
    tmp = tmp_path / "moed"
    tmp.mkdir()
    conf = du.base_config(str(tmp), str(tmp / "synth"), model__path=ckpt,
                          status__port=du.free_port(), engine__backend="cuda",
                          engine__max_tokens=e2e.MAX_TOKENS, engine__sms_free=SMS_FREE,
                          engine__max_channels=2)
    # moed first, as it runs in deployment (a service the engine finds
    # running): the model's CUDA context is made with moed's kernel resident
    with du.Daemon(tmp, conf) as d:
        model = model.to("cuda")
        prompt = torch.randint(0, cfg.vocab_size, (1, e2e.PROMPT),
                               generator=torch.Generator().manual_seed(3)).to("cuda")
        ref_logits, ref_tokens = e2e.prefill_and_decode(model, prompt)
        L0, blk0 = list(e2e.moe_blocks(model))[0]
        xs = [torch.randn(1, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(20 + i))
              .to("cuda") for i in range(3)]
        with torch.no_grad():
            ref_blk = [blk0(x).float() for x in xs]  # the model's own block
        dev = torch.device("cuda", torch.cuda.current_device())
        sess = mcc.DoorbellSession(mc.Client(d.sock_path, timeout=du.wait_s(60)), device=dev,
                                   timeout_s=du.wait_s(5))
        ex = pc.Experts(zero_copy_mode="doorbell", sessions={str(dev): sess})

        def serve(L, x, ids, w):  # the plugins' doorbell path for every MoE layer
            return ex._forward_doorbell(L, x, ids, w, routed_only=False)
        try:
            # one call by itself first: a channel that nothing answers fails
            # here within the call timeout, with its ring words, instead of
            # every call of the model waiting its timeout out in turn
            info = sess.info
            # a call that hangs past its own timeout (a client kernel that
            # never runs) shows where: every thread's Python stack on stderr
            faulthandler.dump_traceback_later(du.wait_s(30))
            x1 = torch.randn(2, info.hidden, device=dev).to(torch.bfloat16)
            ids1 = torch.zeros(2, info.top_k, dtype=torch.int32, device=dev)
            sess.fused_experts(x1, torch.ones(2, info.top_k, device=dev), ids1,
                               info.moe_layers[0])
            torch.cuda.synchronize()
            faulthandler.cancel_dump_traceback_later()
            assert sess.channel.error_word() == 0, (hex(sess.channel.error_word()),
                                                    sess.channel.ring(), d.log()[-2000:])
            assert sess.max_tokens == e2e.MAX_TOKENS < e2e.PROMPT  # prefill goes in chunks
            # one chunk of prefill by itself: a call of the model's that is
            # not answered fails here after one call timeout per layer
            with e2e.Served(model, None, call=serve), torch.no_grad():
                model(input_ids=prompt[:, :e2e.MAX_TOKENS])
                torch.cuda.synchronize()
            sess.check()
            with e2e.Served(model, None, call=serve):
                logits, tokens = e2e.prefill_and_decode(model, prompt, follow=ref_tokens)
                torch.cuda.synchronize()
                sess.check()
                err = e2e.rel_l2(logits, ref_logits)
                agree = sum(a == b for a, b in zip(tokens, ref_tokens))
                print("%s through the doorbell: prefill logits rel-L2 %.2e, teacher-forced "
                      "greedy agreement %d/%d" % (family, err, agree, e2e.STEPS))
                assert err < e2e.LOGITS_TOL
                assert agree >= e2e.MIN_AGREE

                # one block in a CUDA graph: router, copies and doorbell, replayed
                static_x = xs[0].clone()
                with torch.no_grad():
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        blk0(static_x)  # warm-up outside the capture
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        static_y = blk0(static_x)
                    for x, ref in zip(xs, ref_blk):
                        static_x.copy_(x)
                        g.replay()
                        torch.cuda.synchronize()
                        replayed = static_y.clone()
                        with torch.no_grad():
                            eager = blk0(x)
                        torch.cuda.synchronize()
                        assert torch.equal(replayed, eager)
                        e = e2e.rel_l2(replayed.float(), ref)
                        assert e < e2e.LOGITS_TOL, e
                sess.check()
                print("%s: MoE layer %d in a CUDA graph, 3 replays = the eager doorbell call "
                      "bit for bit" % (family, L0))
        finally:
            faulthandler.cancel_dump_traceback_later()  # the first call's, if it failed
            sess.close()
        assert d.stop() == 0, d.log()[-3000:]
