/* moectl.h - subcommands of the moectl tool; each returns a process exit code. */
#ifndef MOED_MOECTL_H
#define MOED_MOECTL_H

/* moectl gen-model --preset P --layers N --seed S --out DIR   (tools/moectl/moectl_gen.c) */
int moectl_gen_main(int argc, char **argv);
/* moectl status|ping|forward|bench [--socket PATH] ...            (tools/moectl/moectl_client.c) */
int moectl_client_main(const char *cmd, int argc, char **argv);

#endif
