/* What both AMX kernels (amx_linear.c, paged_decode_amx.h) need from the OS and the tile unit: the tile
 * configuration's memory layout (palette 1) and the process's permission to use the tile data. */
#ifndef BATCHFLEET_AMX_TILE_H
#define BATCHFLEET_AMX_TILE_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* The process's permission to use AMX tile data (Linux >= 5.16); 0 when granted. */
static inline int amx_request(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }
#endif
