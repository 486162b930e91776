/* moectl.c - command-line tool for moed: model generation and client calls. */
#include <stdio.h>
#include <string.h>

#include "moectl.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moectl COMMAND [options]\n"
            "\n"
            "commands:\n"
            "  gen-model  write a synthetic NVFP4 checkpoint (--preset tiny|qwen3-30b-a3b|deepseek-v3\n"
            "             --layers N --seed S --out DIR)\n"
            "  status     print a short summary of a running daemon (--json: everything)\n"
            "  experts    per-layer expert load since start (--json: SGLang dump layout)\n"
            "  placement  a balanced placement of the experts on --gpus GPUs from that load\n"
            "  ping       round-trip a PING and print the latency\n"
            "  forward    send a random batch, print the latency (--check compares with the CPU reference)\n"
            "  bench      N concurrent connections for a duration; throughput and p50/p99/p999 latency\n"
            "\n"
            "`moectl COMMAND --help` describes each command's options; -V, --version.\n"
            "MOED_SOCKET names the daemon's socket (default /tmp/moed.sock).\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "-V") == 0) {
        printf("moectl %s\n", MOED_VERSION);
        return 0;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "gen-model") == 0)
        return moectl_gen_main(argc - 1, argv + 1);
    if (strcmp(cmd, "status") == 0 || strcmp(cmd, "experts") == 0 ||
        strcmp(cmd, "placement") == 0 || strcmp(cmd, "ping") == 0 ||
        strcmp(cmd, "forward") == 0 || strcmp(cmd, "bench") == 0)
        return moectl_client_main(cmd, argc - 1, argv + 1);
    fprintf(stderr, "moectl: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
