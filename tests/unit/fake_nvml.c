/* fake_nvml.c - a stand-in for libnvidia-ml.so.1 with the entry points
 * bench/lib/power.c uses, for tests/unit/test_power.c (the CI machine has no
 * driver). Deterministic: the energy counter advances 1000 mJ per read, the
 * SM clock is 1755 MHz, the draw 250 W, the limit 700 W; one GPU, at PCI bus
 * id 0000:01:00.0. FAKE_NVML_INIT_FAIL=1 fails nvmlInit_v2,
 * FAKE_NVML_ENERGY_FAIL=1 the energy counter's reads. The temperature is 61
 * C; the clock event reasons are FAKE_NVML_REASONS (a number, 0x4 the power
 * cap) or 0x4. Built with -DFAKE_NVML_PARTIAL it lacks the energy counter's
 * entry point; with -DFAKE_NVML_OLD it is an older driver's library: no
 * temperature, and the reasons under their old name (ClocksThrottleReasons). */
#include <stdlib.h>
#include <string.h>

typedef struct fake_device *fake_device_t;
static struct fake_device {
    int unused;
} the_gpu;

enum { OK = 0, ERR_NOT_FOUND = 6, ERR_INIT = 900, ERR_ENERGY = 901 };

int nvmlInit_v2(void);
int nvmlShutdown(void);
int nvmlDeviceGetHandleByPciBusId_v2(const char *pci, fake_device_t *dev);
int nvmlDeviceGetClockInfo(fake_device_t dev, int type, unsigned *mhz);
int nvmlDeviceGetPowerUsage(fake_device_t dev, unsigned *mw);
int nvmlDeviceGetEnforcedPowerLimit(fake_device_t dev, unsigned *mw);
const char *nvmlErrorString(int r);

int nvmlInit_v2(void)
{
    const char *f = getenv("FAKE_NVML_INIT_FAIL");
    return f && *f == '1' ? ERR_INIT : OK;
}

int nvmlShutdown(void) { return OK; }

int nvmlDeviceGetHandleByPciBusId_v2(const char *pci, fake_device_t *dev)
{
    if (strcmp(pci, "0000:01:00.0"))
        return ERR_NOT_FOUND;
    *dev = &the_gpu;
    return OK;
}

#ifndef FAKE_NVML_PARTIAL
static unsigned long long energy_mj;
int nvmlDeviceGetTotalEnergyConsumption(fake_device_t dev, unsigned long long *mj);
int nvmlDeviceGetTotalEnergyConsumption(fake_device_t dev, unsigned long long *mj)
{
    const char *f = getenv("FAKE_NVML_ENERGY_FAIL");
    if (dev != &the_gpu || (f && *f == '1'))
        return ERR_ENERGY;
    energy_mj += 1000;
    *mj = energy_mj;
    return OK;
}
#endif

int nvmlDeviceGetClockInfo(fake_device_t dev, int type, unsigned *mhz)
{
    (void)dev;
    *mhz = type == 1 ? 1755 : 0; /* NVML_CLOCK_SM */
    return OK;
}

int nvmlDeviceGetPowerUsage(fake_device_t dev, unsigned *mw)
{
    (void)dev;
    *mw = 250000;
    return OK;
}

int nvmlDeviceGetEnforcedPowerLimit(fake_device_t dev, unsigned *mw)
{
    (void)dev;
    *mw = 700000;
    return OK;
}

#ifndef FAKE_NVML_OLD
int nvmlDeviceGetTemperature(fake_device_t dev, int sensor, unsigned *c);
int nvmlDeviceGetTemperature(fake_device_t dev, int sensor, unsigned *c)
{
    (void)dev;
    if (sensor != 0) /* NVML_TEMPERATURE_GPU */
        return ERR_NOT_FOUND;
    *c = 61;
    return OK;
}
#define REASONS_FN nvmlDeviceGetCurrentClocksEventReasons
#else
#define REASONS_FN nvmlDeviceGetCurrentClocksThrottleReasons
#endif

int REASONS_FN(fake_device_t dev, unsigned long long *r);
int REASONS_FN(fake_device_t dev, unsigned long long *r)
{
    (void)dev;
    const char *f = getenv("FAKE_NVML_REASONS");
    *r = f ? strtoull(f, NULL, 0) : 0x4;
    return OK;
}

const char *nvmlErrorString(int r)
{
    switch (r) {
    case ERR_NOT_FOUND: return "Not Found";
    case ERR_INIT: return "fake init failure";
    case ERR_ENERGY: return "fake energy failure";
    default: return "fake error";
    }
}
