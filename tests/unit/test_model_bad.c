/* test_model_bad.c - the checkpoint loader against one broken fixture per
 * error it must name (fixtures in model_fixture.h; the valid models and the
 * family aliases are test_model.c's). */
#include "model_fixture.h"

/* ------------------------------------------------------------ bad inputs */

static void expect_config_fail(const char *cfg, const char *want)
{
    struct moed_dims d;
    write_text("config.json", cfg);
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == MOED_E_MODEL, "rc %d (%s)", rc, err);
    ck_assert_msg(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

START_TEST(config_missing_key)
{
    expect_config_fail("{\"hidden_size\": 64, \"n_routed_experts\": 4, "
                       "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 2, "
                       "\"first_k_dense_replace\": 0}",
                       "config.json: missing 'moe_intermediate_size'");
}
END_TEST

START_TEST(config_missing_experts)
{
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 2, "
                       "\"first_k_dense_replace\": 0}",
                       "config.json: missing 'n_routed_experts' (or alias 'num_experts', "
                       "'num_local_experts')");
}
END_TEST

START_TEST(config_missing_dense_rule)
{
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2}",
                       "config.json: missing 'first_k_dense_replace' (or alias "
                       "'mlp_layer_types', 'decoder_sparse_step')");
}
END_TEST

START_TEST(config_bad_values)
{
    expect_config_fail("{\"hidden_size\": 280, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "config.json: hidden_size 280 is not a multiple of 16 (an NVFP4 row is "
                       "whole 16-weight scale blocks: one E4M3 scale per 16 weights)");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 40, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "moe_intermediate_size 40 is not a multiple of 16");
    /* the message names the key the value came from (Mixtral: intermediate_size) */
    expect_config_fail("{\"model_type\": \"mixtral\", \"hidden_size\": 64, "
                       "\"intermediate_size\": 40, \"num_local_experts\": 4, "
                       "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 2}",
                       "config.json: intermediate_size 40 is not a multiple of 16");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 5, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "num_experts_per_tok 5 is over the 4 routed experts");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"num_experts\": 2000, \"num_experts_per_tok\": 5, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'num_experts' is 2000, allowed 1..1024");
    expect_config_fail("{\"hidden_size\": 131072, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'hidden_size' is 131072, allowed 16..65536");
    expect_config_fail("{\"hidden_size\": \"64\", \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'hidden_size' must be a non-negative integer");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"n_shared_experts\": 9, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'n_shared_experts' is 9, allowed 0..8");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"dense\"]}",
                       "'mlp_layer_types' must be an array of 2 strings");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 2}",
                       "none of the 2 layers is an MoE layer");
    expect_config_fail("{\"hidden_size\": 64,", "config.json: malformed JSON");
}
END_TEST

START_TEST(config_missing_file)
{
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_IO);
    ck_assert_ptr_nonnull(strstr(err, "config.json: cannot open"));
}
END_TEST

START_TEST(group_size_32)
{
    struct fx f = tiny;
    f.hfq = "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 32}}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "hf_quant_config.json: group_size 32 not supported (NVFP4 needs 16)");
}
END_TEST

START_TEST(group_size_32_in_config)
{
    struct fx f = tiny;
    f.hfq = "";
    f.config = "{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
               "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
               "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0, "
               "\"quantization_config\": {\"quant_method\": \"modelopt\", "
               "\"quant_algo\": \"NVFP4\", \"config_groups\": {\"group_0\": {\"weights\": "
               "{\"group_size\": 32}}}}}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL, "group_size 32 not supported (NVFP4 needs 16)");
}
END_TEST

START_TEST(quant_algo_fp8)
{
    struct fx f = tiny;
    f.hfq = "{\"quantization\": {\"quant_algo\": \"FP8\", \"group_size\": 16}}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "hf_quant_config.json: quant_algo 'FP8' not supported (need NVFP4)");
}
END_TEST

START_TEST(no_quant_info)
{
    struct fx f = tiny;
    f.hfq = "";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL, "no quantization info");
}
END_TEST

START_TEST(shard_escape)
{
    struct fx f = tiny;
    f.n_shards = 2;
    f.shard0 = "../x";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL, "shard path '../x' escapes the checkpoint directory");
}
END_TEST

START_TEST(shard_absolute)
{
    struct fx f = tiny;
    f.n_shards = 2;
    f.shard0 = "/etc/passwd";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "shard path '/etc/passwd' escapes the checkpoint directory");
}
END_TEST

START_TEST(shard_missing_file)
{
    struct fx f = tiny;
    f.n_shards = 2;
    f.shard0 = "model-00009-of-00002.safetensors";
    write_model(&f);
    expect_open_fail(0, MOED_E_IO, "model-00009-of-00002.safetensors: cannot open");
}
END_TEST

/* A missing expert tensor is named as the checkpoint's family names it: a
 * routed one, a shared one (sharded), Mixtral's up projection (w3). */
static const struct missing_case {
    int n_shards, mixtral;
    const char *skip;
} missing_cases[] = {
    {0, 0, "model.layers.0.mlp.experts.3.up_proj.weight_scale"},
    {2, 0, "model.layers.1.mlp.shared_experts.down_proj.weight"},
    {0, 1, "model.layers.1.block_sparse_moe.experts.2.w3.weight"},
};

START_TEST(missing_tensor)
{
    const struct missing_case *c = &missing_cases[_i];
    struct fx f = tiny;
    char want[160];
    f.n_shards = c->n_shards;
    f.mixtral = c->mixtral;
    f.S = c->mixtral ? 0 : f.S;
    f.skip = c->skip;
    write_model(&f);
    snprintf(want, sizeof want, "missing tensor '%s'", c->skip);
    expect_open_fail(0, MOED_E_MODEL, want);
}
END_TEST

/* Mixtral has no shared-expert tensors: a config that asks for some is
 * refused before any tensor is looked up. */
START_TEST(mixtral_shared_refused)
{
    struct fx f = tiny;
    f.mixtral = 1;
    f.config = "{\"model_type\": \"mixtral\", \"hidden_size\": 64, \"intermediate_size\": 32, "
               "\"num_local_experts\": 4, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
               "\"num_hidden_layers\": 2}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "1 shared experts, but model_type 'mixtral' names no shared-expert");
}
END_TEST

START_TEST(missing_moe_layer)
{
    /* config says 3 MoE layers, the checkpoint holds layers 0 and 1 only. */
    struct fx f = tiny;
    f.config = "{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
               "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
               "\"num_hidden_layers\": 3, \"first_k_dense_replace\": 0}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "missing tensor 'model.layers.2.mlp.experts.0.gate_proj.weight'");
}
END_TEST

START_TEST(scale_shape_mismatch)
{
    struct fx f = {.H = 256, .I = 64, .E = 2, .S = 0, .k = 1, .layers = 1};
    f.bad_scale = "model.layers.0.mlp.experts.1.gate_proj.weight_scale";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.0.mlp.experts.1.gate_proj.weight_scale': "
                     "weight_scale shape [64, 8] does not match weight [64, 128] "
                     "(expected [64, 16])");
}
END_TEST

START_TEST(weight_dtype_mismatch)
{
    struct fx f = tiny;
    f.bad_dtype = "model.layers.1.mlp.experts.2.down_proj.weight";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.1.mlp.experts.2.down_proj.weight': dtype I8, "
                     "expected U8");
}
END_TEST

START_TEST(weight_shape_mismatch)
{
    /* Tensors for H=64, I=32, config claims I=64. */
    struct fx f = tiny;
    f.config = "{\"hidden_size\": 64, \"moe_intermediate_size\": 64, "
               "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
               "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight': shape [32, 32], "
                     "expected [64, 32] (N, K/2)");
}
END_TEST

START_TEST(scale2_zero)
{
    struct fx f = tiny;
    f.zero_s2 = "model.layers.1.mlp.experts.0.up_proj.weight_scale_2";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.1.mlp.experts.0.up_proj.weight_scale_2': "
                     "weight_scale_2 is 0, must be finite and > 0");
}
END_TEST

/* A NaN block scale (either code, first / middle / last block of a matrix) is
 * refused at load, naming the tensor, the row and the block; the same
 * checkpoint with the byte a number again loads. */
START_TEST(scale_nan)
{
    static const struct {
        const char *t;
        uint32_t row, block;
        uint8_t code;
    } cases[] = {
        {"model.layers.0.mlp.experts.0.gate_proj.weight_scale", 0, 0, 0x7f},
        {"model.layers.1.mlp.experts.2.up_proj.weight_scale", 17, 3, 0xff},
        {"model.layers.1.mlp.shared_experts.down_proj.weight_scale", 63, 1, 0x7f},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct fx f = tiny;
        f.nan_scale = cases[i].t;
        f.nan_row = cases[i].row;
        f.nan_block = cases[i].block;
        f.nan_code = cases[i].code;
        write_model(&f);
        char want[512];
        uint32_t b = cases[i].block;
        snprintf(want, sizeof want,
                 "tensor '%s': block scale at row %u, block %u (weights %u..%u of the row) is "
                 "NaN (E4M3 byte 0x%02x)",
                 cases[i].t, cases[i].row, b, b * 16, b * 16 + 15, cases[i].code);
        expect_open_fail(0, MOED_E_MODEL, want);
    }
    struct fx f = tiny;
    f.nan_scale = cases[0].t;
    f.nan_code = 0x7e; /* 448: the largest finite scale */
    write_model(&f);
    struct moed_model *m;
    ck_assert_msg(moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err) == 0, "%s", err);
    moed_model_close(m);
}
END_TEST

/* hidden_size and moe_intermediate_size need only be whole 16-weight scale
 * blocks: 272 and 48 (multiples of 16, not of 32) load and every matrix has
 * the right shape. */
START_TEST(dims_multiple_of_16)
{
    struct fx f = tiny;
    f.H = 272;
    f.I = 48;
    write_model(&f);
    struct moed_model *m;
    ck_assert_msg(moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err) == 0, "%s", err);
    check_bytes(m, &f);
    moed_model_close(m);
}
END_TEST

/* moed_model_parse_config: the same checks on text in memory (the fuzz
 * target's entry point), with and without hf_quant_config.json. */
START_TEST(parse_config_mem)
{
    static const char cfg[] = "{\"hidden_size\": 272, \"moe_intermediate_size\": 48, "
                              "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                              "\"num_hidden_layers\": 3, \"first_k_dense_replace\": 1, "
                              "\"quantization_config\": {\"quant_method\": \"modelopt\", "
                              "\"quant_algo\": \"NVFP4\"}}";
    static const char q[] = "{\"quantization\": {\"quant_algo\": \"FP8\"}}";
    struct moed_dims d;
    ck_assert_msg(moed_model_parse_config(cfg, strlen(cfg), NULL, 0, &d, err, sizeof err) == 0,
                  "%s", err);
    ck_assert_uint_eq(d.hidden, 272);
    ck_assert_uint_eq(d.inter, 48);
    ck_assert_uint_eq(d.n_moe_layers, 2);
    /* hf_quant_config.json, when present, is what counts */
    ck_assert_int_eq(moed_model_parse_config(cfg, strlen(cfg), q, strlen(q), &d, err, sizeof err),
                     MOED_E_MODEL);
    ck_assert_str_eq(err, "hf_quant_config.json: quant_algo 'FP8' not supported (need NVFP4)");
    /* the length bounds the text: a prefix is malformed, not read past */
    ck_assert_int_eq(moed_model_parse_config(cfg, 20, NULL, 0, &d, err, sizeof err),
                     MOED_E_MODEL);
    ck_assert_msg(strncmp(err, "config.json: malformed JSON near byte ", 38) == 0, "%s", err);
    ck_assert_int_eq(moed_model_parse_config(cfg, strlen(cfg), "[]", 2, &d, err, sizeof err),
                     MOED_E_MODEL);
    ck_assert_str_eq(err, "hf_quant_config.json: not a JSON object");
}
END_TEST

START_TEST(over_budget)
{
    struct fx f = tiny;
    write_model(&f);
    /* 2 layers x 5 experts x 3456 bytes = 34560. */
    expect_open_fail(34559, MOED_E_NOFIT,
                     "model needs 0.0 GiB (34560 bytes) of expert weights but only 0.0 GiB "
                     "(34559 bytes) are available");
    struct moed_model *m;
    ck_assert_int_eq(moed_model_open(dir, 34560, NULL, NULL, &m, err, sizeof err), 0);
    moed_model_close(m);
}
END_TEST

START_TEST(bad_shard_file)
{
    struct fx f = tiny;
    write_model(&f);
    char p[256];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    ck_assert_int_eq(truncate(p, 5), 0);
    expect_open_fail(0, MOED_E_FORMAT, "model.safetensors: truncated: 5 bytes");
}
END_TEST

START_TEST(index_duplicate)
{
    struct fx f = tiny;
    f.n_shards = 1;
    write_model(&f);
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"a\": \"model-00001-of-00001.safetensors\", "
               "\"a\": \"model-00001-of-00001.safetensors\"}}");
    expect_open_fail(0, MOED_E_MODEL, "tensor 'a' listed twice in weight_map");
}
END_TEST

START_TEST(index_points_elsewhere)
{
    /* Index maps a tensor to a shard that does not hold it. */
    struct fx f = tiny;
    f.n_shards = 2;
    write_model(&f);
    char p[256];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *fp = fopen(p, "r");
    char *txt = calloc(1, 1 << 20);
    ck_assert_uint_gt(fread(txt, 1, (1 << 20) - 1, fp), 0);
    fclose(fp);
    cJSON *root = cJSON_Parse(txt);
    cJSON *wm = cJSON_GetObjectItem(root, "weight_map");
    cJSON_ReplaceItemInObject(wm, "model.layers.0.mlp.experts.1.gate_proj.weight",
                              cJSON_CreateString("model-00002-of-00002.safetensors"));
    char *out = cJSON_Print(root);
    write_text("model.safetensors.index.json", out);
    cJSON_free(out);
    cJSON_Delete(root);
    free(txt);
    expect_open_fail(0, MOED_E_MODEL,
                     "missing tensor 'model.layers.0.mlp.experts.1.gate_proj.weight' (the "
                     "index maps it to 'model-00002-of-00002.safetensors'");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("model_bad");
    TCase *bad = tcase_create("bad_input");
    tcase_add_checked_fixture(bad, setup, teardown);
    tcase_set_timeout(bad, 30);
    tcase_add_test(bad, dims_multiple_of_16); /* the loader's dimension rule */
    tcase_add_test(bad, config_missing_key);
    tcase_add_test(bad, config_missing_experts);
    tcase_add_test(bad, config_missing_dense_rule);
    tcase_add_test(bad, config_bad_values);
    tcase_add_test(bad, config_missing_file);
    tcase_add_test(bad, group_size_32);
    tcase_add_test(bad, group_size_32_in_config);
    tcase_add_test(bad, quant_algo_fp8);
    tcase_add_test(bad, no_quant_info);
    tcase_add_test(bad, shard_escape);
    tcase_add_test(bad, shard_absolute);
    tcase_add_test(bad, shard_missing_file);
    tcase_add_loop_test(bad, missing_tensor, 0,
                        (int)(sizeof missing_cases / sizeof missing_cases[0]));
    tcase_add_test(bad, mixtral_shared_refused);
    tcase_add_test(bad, missing_moe_layer);
    tcase_add_test(bad, scale_shape_mismatch);
    tcase_add_test(bad, scale_nan);
    tcase_add_test(bad, parse_config_mem);
    tcase_add_test(bad, weight_dtype_mismatch);
    tcase_add_test(bad, weight_shape_mismatch);
    tcase_add_test(bad, scale2_zero);
    tcase_add_test(bad, over_budget);
    tcase_add_test(bad, bad_shard_file);
    tcase_add_test(bad, index_duplicate);
    tcase_add_test(bad, index_points_elsewhere);
    suite_add_tcase(s, bad);
    return moed_check_run(s);
}
