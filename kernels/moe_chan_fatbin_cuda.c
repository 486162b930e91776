/* moe_chan_fatbin_cuda.c - the client kernel of the doorbell channels
 * (kernels/chan_client/moe_chan_client.cu), built by the Makefile into a
 * fatbin of its own and embedded here as read-only bytes
 * (moe_chan_client_fatbin .. moe_chan_client_fatbin_end, kernels/moe_gpu.h),
 * which the daemon sends with every CHAN_OPEN reply. CUDA builds only. */
#include "moe_gpu.h"

#ifndef MOE_CHAN_FATBIN
#error "MOE_CHAN_FATBIN names the fatbin to embed (Makefile)"
#endif

__asm__(".section .rodata\n"
        ".balign 16\n"
        ".global moe_chan_client_fatbin\n"
        ".type moe_chan_client_fatbin, @object\n"
        "moe_chan_client_fatbin:\n"
        ".incbin \"" MOE_CHAN_FATBIN "\"\n"
        ".global moe_chan_client_fatbin_end\n"
        "moe_chan_client_fatbin_end:\n"
        ".byte 0\n"
        ".previous\n");
