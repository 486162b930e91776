/* test_placement.c - expert placement across devices and the assignment of
 * a batch's pairs (engine/placement.h): a balanced placement from skewed
 * load keeps traffic and replica counts even, splits a hot expert's tokens
 * between its copies, is the same for the same input; a map is checked entry
 * by entry; every pair of a batch goes to a device that holds its expert. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "moed_err.h"
#include "placement.h"

#define DEV(p, e, r) ((p)->dev[(size_t)(e) * MOED_PLACE_MAX_REPLICAS + (r)])

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Zipf-like load: expert e gets ~ base / (1 + e % 17) tokens, shuffled ids */
static void skewed(uint64_t *load, uint32_t n, uint64_t base)
{
    for (uint32_t e = 0; e < n; e++)
        load[e] = base / (1 + (e * 7919u) % 17u) + next() % 5;
}

START_TEST(test_balanced_spreads_load_and_memory)
{
    enum { E = 256 };
    uint64_t load[E];
    skewed(load, E, 100000);
    for (uint32_t nd = 1; nd <= 8; nd++) {
        struct moed_placement p;
        char err[256];
        ck_assert_int_eq(moed_placement_balanced(E, 1, nd, load, nd, 1.0, &p, err, sizeof err), 0);
        double dl[MOED_PLACE_MAX_DEVS], total = 0, mx = 0, heaviest = 0;
        uint32_t dx[MOED_PLACE_MAX_DEVS], mn_x = UINT32_MAX, mx_x = 0;
        moed_placement_loads(&p, load, dl, dx);
        for (uint32_t d = 0; d < nd; d++) {
            total += dl[d];
            mx = dl[d] > mx ? dl[d] : mx;
            mn_x = dx[d] < mn_x ? dx[d] : mn_x;
            mx_x = dx[d] > mx_x ? dx[d] : mx_x;
        }
        for (uint32_t e = 0; e < E; e++) {
            ck_assert_uint_ge(p.n_rep[e], 1);
            double share = (double)load[e] / p.n_rep[e];
            heaviest = share > heaviest ? share : heaviest;
            /* copies on distinct devices */
            for (uint32_t r = 0; r < p.n_rep[e]; r++) {
                ck_assert_uint_lt(DEV(&p, e, r), nd);
                for (uint32_t q = 0; q < r; q++)
                    ck_assert_uint_ne(DEV(&p, e, q), DEV(&p, e, r));
            }
        }
        /* LPT bound: no device over the mean by more than the heaviest replica */
        ck_assert_msg(mx <= total / nd + heaviest + 1e-6, "nd %u: max %.0f mean %.0f heaviest %.0f",
                      nd, mx, total / nd, heaviest);
        ck_assert_uint_le(mx_x - mn_x, 2); /* memory: replicas per device */
        moed_placement_free(&p);
    }
}
END_TEST

START_TEST(test_hot_expert_is_replicated_and_split)
{
    enum { E = 16, ND = 4, T = 64, K = 2 };
    uint64_t load[E];
    for (uint32_t e = 0; e < E; e++)
        load[e] = 10;
    load[3] = 1000; /* over one device's share (1150 / 4) several times */
    struct moed_placement p;
    char err[256];
    ck_assert_int_eq(moed_placement_balanced(E, 0, ND, load, ND, 1.0, &p, err, sizeof err), 0);
    ck_assert_uint_eq(p.n_rep[3], ND);
    ck_assert_uint_eq(p.n_rep[0], 1);
    /* a batch where every token picks expert 3 first: its pairs are split
     * evenly, in token order, over the four copies */
    int32_t ids[T * K];
    for (uint32_t t = 0; t < T; t++) {
        ids[t * K] = 3;
        ids[t * K + 1] = (int32_t)(t % E == 3 ? 4 : t % E);
    }
    uint8_t dev_of[T * K];
    uint32_t count[ND], seen[E];
    ck_assert_int_eq(moed_ep_assign(&p, T, K, ids, dev_of, count, seen), 0);
    uint32_t per[ND] = {0};
    for (uint32_t t = 0; t < T; t++) {
        ck_assert_uint_eq(dev_of[t * K], DEV(&p, 3, t % ND));
        per[dev_of[t * K]]++;
    }
    for (uint32_t d = 0; d < ND; d++)
        ck_assert_uint_eq(per[d], T / ND);
    moed_placement_free(&p);
}
END_TEST

START_TEST(test_same_input_same_placement)
{
    enum { E = 64, ND = 3 };
    uint64_t load[E];
    skewed(load, E, 5000);
    struct moed_placement a, b;
    char err[256];
    ck_assert_int_eq(moed_placement_balanced(E, 2, ND, load, 2, 0.5, &a, err, sizeof err), 0);
    ck_assert_int_eq(moed_placement_balanced(E, 2, ND, load, 2, 0.5, &b, err, sizeof err), 0);
    ck_assert_mem_eq(a.n_rep, b.n_rep, E);
    ck_assert_mem_eq(a.dev, b.dev, (size_t)E * MOED_PLACE_MAX_REPLICAS);
    for (uint32_t e = 0; e < E; e++)
        ck_assert_uint_le(a.n_rep[e], 2); /* max_replicas */
    moed_placement_free(&a);
    moed_placement_free(&b);
}
END_TEST

START_TEST(test_no_load_splits_by_count)
{
    enum { E = 10, ND = 4 };
    uint64_t load[E] = {0};
    struct moed_placement p;
    char err[256];
    ck_assert_int_eq(moed_placement_balanced(E, 0, ND, load, ND, 1.0, &p, err, sizeof err), 0);
    uint32_t dx[ND];
    moed_placement_loads(&p, load, NULL, dx);
    for (uint32_t d = 0; d < ND; d++)
        ck_assert(dx[d] == 2 || dx[d] == 3);
    moed_placement_free(&p);
}
END_TEST

START_TEST(test_every_pair_goes_where_its_expert_is)
{
    enum { E = 32, S = 2, K = 4, ND = 3, KS = K + S };
    for (uint32_t trial = 0; trial < 50; trial++) {
        uint64_t load[E];
        skewed(load, E, 1 + next() % 10000);
        struct moed_placement p;
        char err[256];
        ck_assert_int_eq(moed_placement_balanced(E, S, ND, load, 1 + trial % ND, 0.3 + trial % 3,
                                                 &p, err, sizeof err), 0);
        const uint32_t T = 1 + next() % 256;
        int32_t *ids = malloc((size_t)T * K * sizeof *ids);
        uint8_t *dev_of = malloc((size_t)T * KS);
        ck_assert(ids && dev_of);
        for (uint32_t i = 0; i < T * K; i++)
            ids[i] = next() % 9 == 0 ? -1 : (int32_t)(next() % E);
        uint32_t count[ND], seen[E], sum = 0, empty = 0;
        ck_assert_int_eq(moed_ep_assign(&p, T, K, ids, dev_of, count, seen), 0);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t j = 0; j < KS; j++) {
                const uint8_t d = dev_of[t * KS + j];
                if (j >= K) {
                    ck_assert_uint_eq(d, t % ND); /* shared experts live everywhere */
                    continue;
                }
                const int32_t e = ids[t * K + j];
                if (e < 0) {
                    ck_assert_uint_eq(d, 0xFF);
                    empty++;
                    continue;
                }
                int found = 0;
                for (uint32_t r = 0; r < p.n_rep[e]; r++)
                    found |= DEV(&p, e, r) == d;
                ck_assert_msg(found, "pair (%u, %u) of expert %d on device %u", t, j, e, d);
            }
        for (uint32_t d = 0; d < ND; d++)
            sum += count[d];
        ck_assert_uint_eq(sum + empty, T * KS);
        free(ids);
        free(dev_of);
        moed_placement_free(&p);
    }
}
END_TEST

START_TEST(test_assign_refuses_out_of_range_ids)
{
    struct moed_placement p;
    char err[256];
    uint64_t load[4] = {1, 2, 3, 4};
    ck_assert_int_eq(moed_placement_balanced(4, 0, 2, load, 1, 1.0, &p, err, sizeof err), 0);
    int32_t ids[2] = {1, 4};
    uint8_t dev_of[2];
    uint32_t count[2], seen[4];
    ck_assert_int_eq(moed_ep_assign(&p, 1, 2, ids, dev_of, count, seen), MOED_E_INVAL);
    moed_placement_free(&p);
}
END_TEST

START_TEST(test_map_checks)
{
    struct moed_placement p;
    char err[256];
    const int64_t a[] = {0}, b[] = {1, 0}, bad_dev[] = {2}, twice[] = {1, 1}, neg[] = {-1};
    const int64_t *ok_lists[] = {a, b, a};
    const uint32_t ok_lens[] = {1, 2, 1};
    ck_assert_int_eq(moed_placement_from_lists(3, 1, 2, ok_lists, ok_lens, &p, err, sizeof err), 0);
    ck_assert_uint_eq(p.n_rep[1], 2);
    ck_assert_uint_eq(DEV(&p, 1, 0), 1);
    ck_assert_uint_eq(DEV(&p, 1, 1), 0);
    moed_placement_free(&p);

    const int64_t *l1[] = {a, bad_dev, a};
    ck_assert_int_eq(moed_placement_from_lists(3, 0, 2, l1, ok_lens, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "placement: expert 1, entry 0: device 2 is out of range [0, 2)");
    const int64_t *l2[] = {a, twice, a};
    ck_assert_int_eq(moed_placement_from_lists(3, 0, 2, l2, ok_lens, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "placement: expert 1 names device 1 twice");
    const int64_t *l3[] = {neg, a, a};
    const uint32_t lens3[] = {1, 1, 1};
    ck_assert_int_eq(moed_placement_from_lists(3, 0, 2, l3, lens3, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "placement: expert 0, entry 0: device -1 is out of range [0, 2)");
    const uint32_t lens4[] = {1, 0, 1};
    ck_assert_int_eq(moed_placement_from_lists(3, 0, 2, ok_lists, lens4, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "placement: expert 1 has 0 devices (1..2: each device at most once)");
}
END_TEST

START_TEST(test_balanced_argument_checks)
{
    struct moed_placement p;
    char err[256];
    uint64_t load[4] = {0};
    ck_assert_int_eq(moed_placement_balanced(4, 0, 0, load, 1, 1.0, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "placement: 0 devices (1..8)");
    ck_assert_int_eq(moed_placement_balanced(4, 0, 9, load, 1, 1.0, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_int_eq(moed_placement_balanced(4, 0, 2, load, 3, 1.0, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "placement: max_replicas 3 is out of range [1, 2] (one copy per "
                          "device at most)");
    ck_assert_int_eq(moed_placement_balanced(4, 0, 2, load, 1, 0.0, &p, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "placement: hot 0 is out of range (0, 1e6]");
}
END_TEST

/* ---- the map file (moed_placement_parse_json / _load_json) ---- */

/* A model of 4 layers, MoE layers 1 and 3, 4 routed experts, 1 shared, on 2
 * devices; err for `text`, or "" if it parses (then out is checked). */
static const uint8_t map_moe[4] = {0, 1, 0, 1};

static int map_parse(const char *text, struct moed_placement out[4], char *err, size_t errlen)
{
    err[0] = 0;
    return moed_placement_parse_json(text, strlen(text), "m.json", 4, map_moe, 4, 1, 2, out, err,
                                     errlen);
}

#define MAP_HEAD "{\"gpus\": 2, \"max_replicas\": 2, \"hot\": 1, \"n_experts\": 4, \"n_shared\": 1, "
#define MAP_L1 "{\"layer\": 1, \"experts\": [[0], [1], [0, 1], [1]], \"tokens\": 9}"
#define MAP_L3 "{\"layer\": 3, \"experts\": [[1], [1], [1], [0]]}"

START_TEST(test_map_file_reads_every_layer)
{
    struct moed_placement out[4];
    char err[512];
    ck_assert_int_eq(map_parse(MAP_HEAD "\"layers\": [" MAP_L3 ", " MAP_L1 "]}", out, err,
                               sizeof err), 0);
    ck_assert_ptr_null(out[0].n_rep);
    ck_assert_ptr_null(out[2].n_rep);
    ck_assert_uint_eq(out[1].n_dev, 2);
    ck_assert_uint_eq(out[1].n_shared, 1);
    ck_assert_uint_eq(out[1].n_rep[2], 2);
    ck_assert_uint_eq(DEV(&out[1], 2, 0), 0);
    ck_assert_uint_eq(DEV(&out[1], 2, 1), 1);
    ck_assert_uint_eq(DEV(&out[1], 1, 0), 1);
    ck_assert_uint_eq(out[3].n_rep[0], 1);
    ck_assert_uint_eq(DEV(&out[3], 0, 0), 1);
    ck_assert_uint_eq(DEV(&out[3], 3, 0), 0);
    moed_placement_free(&out[1]);
    moed_placement_free(&out[3]);
}
END_TEST

START_TEST(test_map_file_errors_name_file_layer_entry)
{
    static const struct {
        const char *text, *err;
    } cases[] = {
        {"[1, 2]", "m.json: not a JSON object (moectl placement --json writes the map)"},
        {"{\"gpus\": 3, \"n_experts\": 4, \"n_shared\": 1, \"layers\": []}",
         "m.json: \"gpus\" is 3 but engine.gpus lists 2"},
        {"{\"gpus\": 2, \"n_experts\": 5, \"n_shared\": 1, \"layers\": []}",
         "m.json: \"n_experts\" is 5 but the model's routed experts are 4"},
        {"{\"gpus\": 2, \"n_experts\": 4, \"layers\": []}",
         "m.json: \"n_shared\" is missing or not an integer"},
        {MAP_HEAD "\"layers\": 7}", "m.json: \"layers\" is missing or not an array"},
        {MAP_HEAD "\"layers\": [" MAP_L1 "]}",
         "m.json: MoE layer 3 is not in the map (every MoE layer must be)"},
        {MAP_HEAD "\"layers\": [" MAP_L1 ", " MAP_L1 "]}", "m.json: layer 1 is listed twice"},
        {MAP_HEAD "\"layers\": [{\"layer\": 2, \"experts\": []}]}",
         "m.json: layers[0]: layer 2 is not an MoE layer of the model (4 layers)"},
        {MAP_HEAD "\"layers\": [{\"layer\": 1.5}]}",
         "m.json: layers[0] is not an object with an integer \"layer\""},
        {MAP_HEAD "\"layers\": [{\"layer\": 1, \"experts\": [[0], [1], [0]]}]}",
         "m.json: layer 1: \"experts\" must be an array of 4 device lists (one per routed "
         "expert)"},
        {MAP_HEAD "\"layers\": [{\"layer\": 1, \"experts\": [[0], [], [0], [1]]}]}",
         "m.json: layer 1, expert 1: not a list of 1..8 device indices"},
        {MAP_HEAD "\"layers\": [{\"layer\": 1, \"experts\": [[0], [1, \"a\"], [0], [1]]}]}",
         "m.json: layer 1, expert 1, entry 1: not a device index"},
        {MAP_HEAD "\"layers\": [" MAP_L1 ", {\"layer\": 3, \"experts\": [[0], [1], [2], [1]]}]}",
         "m.json: layer 3: expert 2, entry 0: device 2 is out of range [0, 2)"},
        {MAP_HEAD "\"layers\": [{\"layer\": 1, \"experts\": [[0], [1, 1], [0], [1]]}]}",
         "m.json: layer 1: expert 1 names device 1 twice"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct moed_placement out[4];
        char err[512];
        ck_assert_int_eq(map_parse(cases[i].text, out, err, sizeof err), MOED_E_CONFIG);
        ck_assert_str_eq(err, cases[i].err);
        for (int l = 0; l < 4; l++) /* nothing left allocated on an error */
            ck_assert_ptr_null(out[l].n_rep);
    }
}
END_TEST

START_TEST(test_map_file_load)
{
    char path[] = "/tmp/moed-test-placement-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    const char *text = MAP_HEAD "\"layers\": [" MAP_L1 ", " MAP_L3 "]}";
    ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    struct moed_placement out[4];
    char err[512] = "";
    ck_assert_int_eq(moed_placement_load_json(path, 4, map_moe, 4, 1, 2, out, err, sizeof err),
                     0);
    ck_assert_uint_eq(out[3].n_rep[1], 1);
    moed_placement_free(&out[1]);
    moed_placement_free(&out[3]);
    unlink(path);
    ck_assert_int_eq(moed_placement_load_json(path, 4, map_moe, 4, 1, 2, out, err, sizeof err),
                     MOED_E_CONFIG);
    ck_assert_ptr_nonnull(strstr(err, path));
    ck_assert_ptr_nonnull(strstr(err, "No such file"));
    /* a directory, and a map over the size limit: config errors naming the key */
    ck_assert_int_eq(moed_placement_load_json("/tmp", 4, map_moe, 4, 1, 2, out, err, sizeof err),
                     MOED_E_CONFIG);
    ck_assert_str_eq(err, "engine.placement: not a readable regular file");
    char big[] = "/tmp/moed-test-placement-XXXXXX";
    fd = mkstemp(big);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, MOED_PLACE_MAX_JSON_BYTES + 1), 0); /* sparse */
    close(fd);
    ck_assert_int_eq(moed_placement_load_json(big, 4, map_moe, 4, 1, 2, out, err, sizeof err),
                     MOED_E_CONFIG);
    char want[128];
    snprintf(want, sizeof want, "engine.placement: %d bytes, over the %d-byte cap",
             MOED_PLACE_MAX_JSON_BYTES + 1, MOED_PLACE_MAX_JSON_BYTES);
    ck_assert_str_eq(err, want);
    unlink(big);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("placement");
    TCase *tc = tcase_create("placement");
    tcase_add_test(tc, test_balanced_spreads_load_and_memory);
    tcase_add_test(tc, test_hot_expert_is_replicated_and_split);
    tcase_add_test(tc, test_same_input_same_placement);
    tcase_add_test(tc, test_no_load_splits_by_count);
    tcase_add_test(tc, test_every_pair_goes_where_its_expert_is);
    tcase_add_test(tc, test_assign_refuses_out_of_range_ids);
    tcase_add_test(tc, test_map_checks);
    tcase_add_test(tc, test_balanced_argument_checks);
    tcase_add_test(tc, test_map_file_reads_every_layer);
    tcase_add_test(tc, test_map_file_errors_name_file_layer_entry);
    tcase_add_test(tc, test_map_file_load);
    suite_add_tcase(s, tc);
    return moed_check_run(s);
}
