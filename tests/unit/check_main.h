/* check_main.h - the one Check runner of the unit tests.
 *
 * Each tests/unit/test_*.c builds its Suite and ends main() with
 *     return moed_check_run(suite);
 * which runs every case (CK_NORMAL output; Check's own CK_RUN_SUITE /
 * CK_RUN_CASE environment variables pick one) and gives the exit status. */
#ifndef MOED_CHECK_MAIN_H
#define MOED_CHECK_MAIN_H

#include <check.h>
#include <stdlib.h>

static inline int moed_check_run(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif
