/* test_model.c - the checkpoint loader against valid fixtures (model_fixture.h:
 * tiny NVFP4-shaped checkpoints, st_writer + deterministic bytes) and
 * hand-written config.json files for DeepSeek-V3, GLM-4.5, GLM-5 and
 * Qwen3-MoE (values from notes/formats-and-interfaces.md section 2.2); one
 * broken fixture per error the loader must name is test_model_bad.c. */
#include "model_fixture.h"

/* ------------------------------------------------------------ valid models */

/* One MoE expert of H=64, I=32: gate and up [32, 64], down [64, 32]; each
 * matrix 2048 codes -> 1024 bytes of weights + 128 bytes of block scales. */
#define TINY_EXPERT_BYTES (3u * (1024u + 128u))

START_TEST(tiny_sharded)
{
    struct fx f = tiny;
    f.n_shards = 2;
    write_model(&f);
    struct moed_model *m;
    struct prog pr = {.monotonic = 1};
    int rc = moed_model_open(dir, 0, on_progress, &pr, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    const struct moed_dims *d = moed_model_dims(m);
    ck_assert_uint_eq(d->hidden, 64);
    ck_assert_uint_eq(d->inter, 32);
    ck_assert_uint_eq(d->n_experts, 4);
    ck_assert_uint_eq(d->top_k, 2);
    ck_assert_uint_eq(d->n_shared, 1);
    ck_assert_uint_eq(d->n_layers, 2);
    ck_assert_uint_eq(d->n_moe_layers, 2);
    ck_assert_str_eq(d->family, "deepseek_v3");
    ck_assert_str_eq(moed_model_dir(m), dir);
    ck_assert_uint_eq(moed_model_expert_bytes(m), TINY_EXPERT_BYTES);
    /* 2 layers x (4 routed + 1 shared) experts. */
    ck_assert_uint_eq(moed_model_weight_bytes(m), 2u * 5u * TINY_EXPERT_BYTES);
    ck_assert_int_eq(moed_model_is_moe_layer(m, 0), 1);
    ck_assert_int_eq(moed_model_is_moe_layer(m, 1), 1);
    ck_assert_int_eq(moed_model_is_moe_layer(m, 2), 0);
    ck_assert_ptr_null(moed_model_layer(m, 2));
    ck_assert_ptr_null(moed_model_layer(m, UINT32_MAX));
    check_bytes(m, &f);
    ck_assert_int_ge(pr.calls, 1);
    ck_assert_int_le(pr.calls, 101);
    ck_assert_int_eq(pr.monotonic, 1);
    ck_assert_uint_eq(pr.last, 2u * 5u * TINY_EXPERT_BYTES);
    ck_assert_uint_eq(pr.total, 2u * 5u * TINY_EXPERT_BYTES);
    moed_model_close(m);
}
END_TEST

/* Single file, multimodal prefix, scale_2 as [1], no input_scale, quant info
 * only in config.json, two shared experts, and exactly the budget. */
START_TEST(single_file_variants)
{
    struct fx f = {.H = 96, .I = 64, .E = 3, .S = 2, .k = 3, .layers = 1};
    f.prefix = "model.language_model.";
    f.scale2_vec = 1;
    f.no_input_scale = 1;
    f.hfq = "";
    f.config = "{\"model_type\": \"glm4_moe\", \"hidden_size\": 96, "
               "\"moe_intermediate_size\": 64, \"n_routed_experts\": 3, "
               "\"num_experts_per_tok\": 3, \"n_shared_experts\": 2, "
               "\"num_hidden_layers\": 1, \"first_k_dense_replace\": 0, "
               "\"quantization_config\": {\"quant_method\": \"modelopt\", "
               "\"quant_algo\": \"NVFP4\", \"config_groups\": {\"group_0\": {\"weights\": "
               "{\"num_bits\": 4, \"type\": \"float\", \"group_size\": 16}}}}}";
    write_model(&f);
    uint64_t per = 2 * (64 * 96 / 2 + 64 * 96 / 16) + (96 * 64 / 2 + 96 * 64 / 16);
    struct moed_model *m;
    int rc = moed_model_open(dir, 5 * per, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(moed_model_weight_bytes(m), 5 * per);
    ck_assert_uint_eq(moed_model_expert_bytes(m), per);
    ck_assert_str_eq(moed_model_dims(m)->family, "glm4_moe");
    check_bytes(m, &f);
    moed_model_close(m);
}
END_TEST

/* ------------------------------------------------------ family aliases */

START_TEST(alias_deepseek_v3)
{
    write_text("config.json",
               "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"model_type\": "
               "\"deepseek_v3\", \"hidden_size\": 7168, \"intermediate_size\": 18432, "
               "\"moe_intermediate_size\": 2048, \"n_routed_experts\": 256, "
               "\"n_shared_experts\": 1, \"num_experts_per_tok\": 8, \"n_group\": 8, "
               "\"topk_group\": 4, \"routed_scaling_factor\": 2.5, \"scoring_func\": "
               "\"sigmoid\", \"topk_method\": \"noaux_tc\", \"norm_topk_prob\": true, "
               "\"first_k_dense_replace\": 3, \"num_hidden_layers\": 61, "
               "\"num_nextn_predict_layers\": 1}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 7168);
    ck_assert_uint_eq(d.inter, 2048);
    ck_assert_uint_eq(d.n_experts, 256);
    ck_assert_uint_eq(d.top_k, 8);
    ck_assert_uint_eq(d.n_shared, 1);
    ck_assert_uint_eq(d.n_layers, 61);
    ck_assert_uint_eq(d.n_moe_layers, 58);
    ck_assert_str_eq(d.family, "deepseek_v3");
}
END_TEST

START_TEST(alias_glm45)
{
    write_text("config.json",
               "{\"model_type\": \"glm4_moe\", \"hidden_size\": 5120, "
               "\"moe_intermediate_size\": 1536, \"n_routed_experts\": 160, "
               "\"n_shared_experts\": 1, \"num_experts_per_tok\": 8, \"n_group\": 1, "
               "\"topk_group\": 1, \"routed_scaling_factor\": 2.5, \"norm_topk_prob\": true, "
               "\"first_k_dense_replace\": 3, \"num_hidden_layers\": 92}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 5120);
    ck_assert_uint_eq(d.inter, 1536);
    ck_assert_uint_eq(d.n_experts, 160);
    ck_assert_uint_eq(d.top_k, 8);
    ck_assert_uint_eq(d.n_shared, 1);
    ck_assert_uint_eq(d.n_layers, 92);
    ck_assert_uint_eq(d.n_moe_layers, 89);
    ck_assert_str_eq(d.family, "glm4_moe");
}
END_TEST

START_TEST(alias_glm5)
{
    /* 78 layers: 3 dense then 75 sparse. */
    char cfg[4096];
    size_t o = (size_t)snprintf(cfg, sizeof cfg,
                                "{\"model_type\": \"glm_moe_dsa\", \"hidden_size\": 6144, "
                                "\"moe_intermediate_size\": 2048, \"n_routed_experts\": 256, "
                                "\"n_shared_experts\": 1, \"num_experts_per_tok\": 8, "
                                "\"num_hidden_layers\": 78, \"mlp_layer_types\": [");
    for (int l = 0; l < 78; l++)
        o += (size_t)snprintf(cfg + o, sizeof cfg - o, "%s\"%s\"", l ? ", " : "",
                              l < 3 ? "dense" : "sparse");
    snprintf(cfg + o, sizeof cfg - o, "]}");
    write_text("config.json", cfg);
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 6144);
    ck_assert_uint_eq(d.inter, 2048);
    ck_assert_uint_eq(d.n_experts, 256);
    ck_assert_uint_eq(d.n_shared, 1);
    ck_assert_uint_eq(d.n_layers, 78);
    ck_assert_uint_eq(d.n_moe_layers, 75);
    ck_assert_str_eq(d.family, "glm_moe_dsa");
}
END_TEST

START_TEST(alias_qwen3)
{
    write_text("config.json",
               "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 2048, "
               "\"moe_intermediate_size\": 768, \"num_experts\": 128, "
               "\"num_experts_per_tok\": 8, \"norm_topk_prob\": true, "
               "\"decoder_sparse_step\": 1, \"mlp_only_layers\": [], "
               "\"num_hidden_layers\": 48}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 2048);
    ck_assert_uint_eq(d.inter, 768);
    ck_assert_uint_eq(d.n_experts, 128);
    ck_assert_uint_eq(d.top_k, 8);
    ck_assert_uint_eq(d.n_shared, 0); /* absent -> 0 */
    ck_assert_uint_eq(d.n_layers, 48);
    ck_assert_uint_eq(d.n_moe_layers, 48);
    ck_assert_str_eq(d.family, "qwen3_moe");
}
END_TEST

/* transformers 5 writes Qwen3-MoE's expert count as num_local_experts (its
 * config class's attribute map reads num_experts from it), as Mixtral does;
 * Mixtral-style experts are intermediate_size wide (no moe_intermediate_size);
 * moe_intermediate_size wins where both are given. Ling-style configs name
 * their shared experts num_shared_experts. */
/* config.json from `json`, read back (it must parse). */
static struct moed_dims dims_of(const char *json)
{
    struct moed_dims d;
    write_text("config.json", json);
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    return d;
}

START_TEST(alias_transformers5)
{
    struct moed_dims d = dims_of(
        "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 2048, \"intermediate_size\": 6144, "
        "\"moe_intermediate_size\": 768, \"num_local_experts\": 128, "
        "\"num_experts_per_tok\": 8, \"decoder_sparse_step\": 1, \"mlp_only_layers\": [], "
        "\"num_hidden_layers\": 48, \"transformers_version\": \"5.24.0\"}");
    ck_assert_uint_eq(d.inter, 768);
    ck_assert_uint_eq(d.n_experts, 128);
    ck_assert_uint_eq(d.n_moe_layers, 48);
    /* Mixtral-8x7B's keys as transformers 5 writes them: no layer key, every
     * layer is MoE */
    d = dims_of("{\"model_type\": \"mixtral\", \"hidden_size\": 4096, \"intermediate_size\": "
                "14336, \"num_local_experts\": 8, \"num_experts_per_tok\": 2, "
                "\"num_hidden_layers\": 32, \"sliding_window\": null}");
    ck_assert_uint_eq(d.inter, 14336);
    ck_assert_uint_eq(d.n_experts, 8);
    ck_assert_uint_eq(d.n_shared, 0);
    ck_assert_uint_eq(d.n_moe_layers, 32);
    ck_assert_str_eq(d.family, "mixtral");
    d = dims_of("{\"model_type\": \"bailing_moe\", \"hidden_size\": 2048, "
                "\"moe_intermediate_size\": 512, \"num_experts\": 256, "
                "\"num_shared_experts\": 1, \"num_experts_per_tok\": 8, "
                "\"num_hidden_layers\": 20, \"first_k_dense_replace\": 1}");
    ck_assert_uint_eq(d.n_shared, 1);
    ck_assert_uint_eq(d.n_moe_layers, 19);
}
END_TEST

/* Which layers are MoE, checked through a loaded model holding exactly
 * those layers' tensors. */
static void check_layers(const char *config, uint32_t layers, uint32_t S, uint64_t mask)
{
    struct fx f = tiny;
    f.config = config;
    f.layers = layers;
    f.S = S;
    f.moe_mask = mask;
    write_model(&f);
    struct moed_model *m;
    int rc = moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    uint32_t n = 0;
    for (uint32_t l = 0; l < layers; l++) {
        ck_assert_int_eq(moed_model_is_moe_layer(m, l), (int)(mask >> l & 1));
        n += (uint32_t)(mask >> l & 1);
    }
    ck_assert_uint_eq(moed_model_dims(m)->n_moe_layers, n);
    ck_assert_uint_eq(moed_model_weight_bytes(m), (uint64_t)n * (4 + S) * TINY_EXPERT_BYTES);
    check_bytes(m, &f);
    moed_model_close(m);
}

START_TEST(layers_first_k_dense)
{
    check_layers("{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64, "
                 "\"moe_intermediate_size\": 32, \"n_routed_experts\": 4, "
                 "\"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
                 "\"num_hidden_layers\": 4, \"first_k_dense_replace\": 2}",
                 4, 1, 0xc);
}
END_TEST

START_TEST(layers_mlp_layer_types)
{
    check_layers("{\"model_type\": \"glm_moe_dsa\", \"hidden_size\": 64, "
                 "\"moe_intermediate_size\": 32, \"n_routed_experts\": 4, "
                 "\"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
                 "\"num_hidden_layers\": 4, "
                 "\"mlp_layer_types\": [\"dense\", \"sparse\", \"dense\", \"sparse\"]}",
                 4, 1, 0xa);
}
END_TEST

START_TEST(layers_qwen3_sparse_step)
{
    /* step 2: layers 1, 3, 5 are MoE; mlp_only_layers removes 3. */
    check_layers("{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, "
                 "\"moe_intermediate_size\": 32, \"num_experts\": 4, "
                 "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 6, "
                 "\"decoder_sparse_step\": 2, \"mlp_only_layers\": [3]}",
                 6, 0, 0x22);
}
END_TEST

/* Mixtral: block_sparse_moe.experts.{e}.{w1,w3,w2} (gate, up, down), every
 * layer MoE, no shared experts; the bytes land in gate/up/down in that order. */
START_TEST(mixtral_naming)
{
    struct fx f = tiny;
    f.mixtral = 1;
    f.S = 0;
    f.layers = 3;
    write_model(&f);
    struct moed_model *m;
    int rc = moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_str_eq(moed_model_dims(m)->family, "mixtral");
    ck_assert_uint_eq(moed_model_dims(m)->n_moe_layers, 3);
    ck_assert_uint_eq(moed_model_weight_bytes(m), 3u * 4 * TINY_EXPERT_BYTES);
    check_bytes(m, &f);
    moed_model_close(m);
}
END_TEST

/* MiniMax-M1 and MiniMax-Text-01 ship remote code (model_type minimax_m1 /
 * minimax_text_01; transformers has neither class): their config.json keys
 * field for field, from MiniMaxAI/MiniMax-M1-80k's config.json
 * (transformers_version 4.45.2), with the dims cut to the tiny fixture's
 * (hidden 6144 -> 64, intermediate 9216 -> 32, 32 -> 4 experts, 80 -> 3
 * layers, attn_type_list cut to 3). Mixtral's tensor layout; no layer key:
 * every layer MoE; shared_intermediate_size 0: no shared expert. */
static void check_minimax(const char *model_type)
{
    char cfg[2048];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"MiniMaxM1ForCausalLM\"], \"attention_dropout\": 0.0, "
             "\"attn_type_list\": [0, 0, 1], \"auto_map\": {\"AutoConfig\": "
             "\"configuration_minimax_m1.MiniMaxM1Config\", \"AutoModelForCausalLM\": "
             "\"modeling_minimax_m1.MiniMaxM1ForCausalLM\"}, \"bos_token_id\": null, "
             "\"eos_token_id\": null, \"head_dim\": 128, \"hidden_act\": \"silu\", "
             "\"hidden_size\": 64, \"initializer_range\": 0.02, \"intermediate_size\": 32, "
             "\"layernorm_full_attention_alpha\": 3.5565588200778455, "
             "\"layernorm_full_attention_beta\": 1.0, "
             "\"layernorm_linear_attention_alpha\": 3.5565588200778455, "
             "\"layernorm_linear_attention_beta\": 1.0, \"layernorm_mlp_alpha\": "
             "3.5565588200778455, \"layernorm_mlp_beta\": 1.0, \"max_position_embeddings\": "
             "10240000, \"model_type\": \"%s\", \"num_attention_heads\": 64, "
             "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 3, \"num_key_value_heads\": 8, "
             "\"num_local_experts\": 4, \"output_router_logits\": false, \"postnorm\": true, "
             "\"rms_norm_eps\": 1e-05, \"rope_theta\": 10000000, \"rotary_dim\": 64, "
             "\"router_aux_loss_coef\": 0.001, \"router_jitter_noise\": 0.0, "
             "\"shared_intermediate_size\": 0, \"shared_moe_mode\": \"sigmoid\", "
             "\"sliding_window\": null, \"tie_word_embeddings\": false, "
             "\"transformers_version\": \"4.45.2\", \"use_cache\": true, \"vocab_size\": "
             "200064}",
             model_type);
    struct fx f = tiny;
    f.mixtral = 1;
    f.S = 0;
    f.layers = 3;
    f.config = cfg;
    write_model(&f);
    struct moed_model *m;
    int rc = moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s: %s", model_type, err);
    const struct moed_dims *d = moed_model_dims(m);
    ck_assert_str_eq(d->family, model_type);
    ck_assert_uint_eq(d->n_experts, 4);
    ck_assert_uint_eq(d->inter, 32);
    ck_assert_uint_eq(d->n_shared, 0);
    ck_assert_uint_eq(d->n_moe_layers, 3);
    ck_assert_uint_eq(moed_model_weight_bytes(m), 3u * 4 * TINY_EXPERT_BYTES);
    check_bytes(m, &f);
    moed_model_close(m);
}

START_TEST(minimax_remote_code_naming)
{
    check_minimax("minimax_m1");
    teardown();
    setup();
    check_minimax("minimax_text_01");
}
END_TEST

START_TEST(alias_text_config)
{
    write_text("config.json",
               "{\"model_type\": \"qwen3_vl_moe\", \"text_config\": {\"model_type\": "
               "\"qwen3_vl_moe_text\", \"hidden_size\": 2048, \"moe_intermediate_size\": 768, "
               "\"num_experts\": 128, \"num_experts_per_tok\": 8, \"decoder_sparse_step\": 1, "
               "\"num_hidden_layers\": 48}}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.n_experts, 128);
    ck_assert_uint_eq(d.n_moe_layers, 48);
    ck_assert_str_eq(d.family, "qwen3_vl_moe");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("model");
    TCase *good = tcase_create("valid");
    TCase *alias = tcase_create("aliases");
    TCase *all[2] = {good, alias};
    for (int i = 0; i < 2; i++) {
        tcase_add_checked_fixture(all[i], setup, teardown);
        tcase_set_timeout(all[i], 30);
    }
    tcase_add_test(good, tiny_sharded);
    tcase_add_test(good, single_file_variants);
    tcase_add_test(alias, alias_deepseek_v3);
    tcase_add_test(alias, alias_glm45);
    tcase_add_test(alias, alias_glm5);
    tcase_add_test(alias, alias_qwen3);
    tcase_add_test(alias, alias_transformers5);
    tcase_add_test(alias, alias_text_config);
    tcase_add_test(alias, mixtral_naming);
    tcase_add_test(alias, minimax_remote_code_naming);
    tcase_add_test(alias, layers_first_k_dense);
    tcase_add_test(alias, layers_mlp_layer_types);
    tcase_add_test(alias, layers_qwen3_sparse_step);
    suite_add_tcase(s, good);
    suite_add_tcase(s, alias);
    return moed_check_run(s);
}
