/*
 * fakenvml.c: a fake libnvidia-ml.so.1 for tests on machines without a GPU.
 *
 * The real nvidia-ml-py bindings load it by soname (build with -Wl,-soname,libnvidia-ml.so.1 and
 * put its directory on LD_LIBRARY_PATH, or preload it with ctypes.CDLL(path, RTLD_GLOBAL)).
 * Struct layouts follow nvidia-ml-py's pynvml.py (13.x): nvmlMemory_t, nvmlMemory_v2_t,
 * nvmlUtilization_t, nvmlProcessInfo_v2_t (the v3 functions use the same layout).
 *
 * What it reports comes from the text file named by MEMD_FAKE_NVML_CONFIG. The file is read on
 * every call (it is small), so a test may rewrite it while a process samples; write it
 * atomically (temporary file + rename). Unset or unreadable: as if the driver were not loaded
 * (nvmlInit fails with Driver Not Loaded). An empty file: a driver with no GPUs.
 *
 *   # a comment; blank lines are ignored
 *   init <error>                  what nvmlInit returns. Not "ok" after a successful init: every
 *                                 later call returns Uninitialized (the driver went away)
 *   driver 550.54.15              nvmlSystemGetDriverVersion (default 550.54.15)
 *   nvml 12.550.54.15             nvmlSystemGetNVMLVersion (default 12.550.54.15)
 *   gpu <uuid> [key=value ...] [name=<the rest of the line, spaces allowed>]
 *       total=<size> used=<size> reserved=<size>
 *                                 memory as the v2 query reports it (used excludes reserved);
 *                                 the v1 query reports used+reserved; free = total-reserved-used
 *       util=<percent>|na         GPU utilization (default 0; na: Not Supported)
 *       memutil=<percent>         memory-controller utilization (default 0)
 *       fail=<error>              every query on this device fails (the handle lookup works)
 *       memory=<error>            the memory queries (v1 and v2) fail, e.g. not_supported (GB10)
 *       procs=<error>             the running-process queries fail
 *       hang=<milliseconds>       the memory queries stall that long first (a wedged driver)
 *       mig=on|off|<error>        MIG mode, or the error its MIG queries return (default:
 *                                 Not Supported; on when the GPU has mig lines)
 *       pci=<bus id>|<error>      nvmlDeviceGetPciInfo_v3's busId (default 00000000:NN:00.0,
 *                                 NN = 0x10 + the GPU's index, in hex); a MIG device answers
 *                                 Not Supported (its GPU's bus id is the one to use)
 *   mig <parent-uuid> <uuid> [total= used= reserved= util= fail= memory= procs= name=]
 *                                 a MIG device of an earlier gpu (utilization defaults to na);
 *                                 its GPU instance id (nvmlDeviceGetGpuInstanceId) is its
 *                                 position among its GPU's mig lines plus one
 *   proc <uuid> <pid> <size>|na [graphics]
 *                                 a process on a GPU or MIG device (compute unless "graphics");
 *                                 na: NVML_VALUE_NOT_AVAILABLE, as on WDDM or without permission
 *
 *   <size>  bytes, or a number followed by KiB, MiB, GiB or TiB
 *   <error> ok | not_supported | no_permission | driver_not_loaded | lost | unknown |
 *           lib_rm_mismatch | uninitialized
 *
 * Limits: 64 devices (GPUs and MIG devices together), 7 MIG devices per GPU, 256 proc lines,
 * 95 characters per uuid or name. Unknown lines and keys are reported on stderr (once per change
 * of the file) and ignored.
 * Built with -DFAKE_NO_V2 it leaves out nvmlDeviceGetMemoryInfo_v2 and the _v3 process
 * functions, as a driver before R510 does; with -DFAKE_NO_PROCESS_V2 as well, the _v2 process
 * functions too (only the unversioned v1 ones remain), as R450 and older. The bindings then raise
 * NVMLError_FunctionNotFound. Left out on purpose: everything memd does not call (the real
 * library has hundreds of symbols).
 * fakenvml_init_calls() counts nvmlInit attempts, for tests of the re-initialisation back-off.
 */
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24)))
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* v2, and what nvidia-ml-py passes to the v3 functions */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t; /* the unversioned functions, kept by every driver since */

#define NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NOT_AVAILABLE_UINT 0xFFFFFFFFU
#define MAX_DEVICES 64 /* GPUs and MIG devices together */
#define MAX_PROCS 256
#define MAX_MIG 7 /* what nvmlDeviceGetMaxMigDeviceCount reports, as on an A100 */
#define TEXT 96

struct fake_device {
    char uuid[TEXT], name[TEXT], pci[TEXT];
    int pci_fail;
    unsigned long long total, used, reserved;
    unsigned int util, memutil;
    int util_na, fail, memory_fail, procs_fail;
    int mig_mode; /* -1 Not Supported, 0 off, 1 on */
    int mig_fail;
    int parent;   /* index into devices[] of the physical GPU, -1 for a physical GPU */
    int mig_index;
    unsigned int hang_ms; /* the memory queries stall this long, as a wedged driver does */
};

struct fake_proc {
    int device;
    unsigned int pid;
    unsigned long long used;
    int graphics;
};

static struct {
    int init_error;
    char driver[TEXT], nvml[TEXT];
    int ndevices, nprocs;
    struct fake_device devices[MAX_DEVICES];
    struct fake_proc procs[MAX_PROCS];
} cfg;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int refcount;        /* successful inits minus shutdowns */
static int init_calls;
static char *last_text;     /* the file as last parsed; warnings only when it changes */

static const struct { const char *name; int code; } errors[] = {
    {"ok", NVML_SUCCESS},
    {"not_supported", NVML_ERROR_NOT_SUPPORTED},
    {"no_permission", NVML_ERROR_NO_PERMISSION},
    {"driver_not_loaded", NVML_ERROR_DRIVER_NOT_LOADED},
    {"lost", NVML_ERROR_GPU_IS_LOST},
    {"unknown", NVML_ERROR_UNKNOWN},
    {"lib_rm_mismatch", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"uninitialized", NVML_ERROR_UNINITIALIZED},
};

static int warn_enabled;

static void warn(int line, const char *what, const char *token)
{
    if (warn_enabled)
        fprintf(stderr, "fakenvml: line %d: %s '%s' ignored\n", line, what, token);
}

static int parse_error(const char *s, int line)
{
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (strcmp(s, errors[i].name) == 0)
            return errors[i].code;
    warn(line, "unknown error name", s);
    return NVML_ERROR_UNKNOWN;
}

static unsigned long long parse_size(const char *s, int line)
{
    char *end;
    unsigned long long value = strtoull(s, &end, 10);
    static const char *units[] = {"", "KiB", "MiB", "GiB", "TiB"};
    for (int i = 0; i < 5; i++)
        if (strcmp(end, units[i]) == 0)
            return value << (10 * i);
    warn(line, "bad size", s);
    return 0;
}

static void copy_text(char *dst, const char *src)
{
    snprintf(dst, TEXT, "%s", src);
}

static int find_device(const char *uuid)
{
    for (int i = 0; i < cfg.ndevices; i++)
        if (strcmp(cfg.devices[i].uuid, uuid) == 0)
            return i;
    return -1;
}

/* key=value tokens of a gpu or mig line */
static void parse_device_keys(struct fake_device *d, char *rest, int line)
{
    char *save, *tok;
    for (tok = strtok_r(rest, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
        char *value = strchr(tok, '=');
        if (!value) {
            warn(line, "token", tok);
            continue;
        }
        *value++ = '\0';
        if (strcmp(tok, "total") == 0) d->total = parse_size(value, line);
        else if (strcmp(tok, "used") == 0) d->used = parse_size(value, line);
        else if (strcmp(tok, "reserved") == 0) d->reserved = parse_size(value, line);
        else if (strcmp(tok, "util") == 0) {
            d->util_na = strcmp(value, "na") == 0;
            d->util = d->util_na ? 0 : (unsigned int)atoi(value);
        }
        else if (strcmp(tok, "memutil") == 0) d->memutil = (unsigned int)atoi(value);
        else if (strcmp(tok, "fail") == 0) d->fail = parse_error(value, line);
        else if (strcmp(tok, "memory") == 0) d->memory_fail = parse_error(value, line);
        else if (strcmp(tok, "procs") == 0) d->procs_fail = parse_error(value, line);
        else if (strcmp(tok, "hang") == 0) d->hang_ms = (unsigned int)strtoul(value, NULL, 10);
        else if (strcmp(tok, "mig") == 0 && strcmp(value, "on") == 0) d->mig_mode = 1;
        else if (strcmp(tok, "mig") == 0 && strcmp(value, "off") == 0) d->mig_mode = 0;
        else if (strcmp(tok, "mig") == 0) d->mig_fail = parse_error(value, line);
        else if (strcmp(tok, "pci") == 0 && strchr(value, ':')) copy_text(d->pci, value);
        else if (strcmp(tok, "pci") == 0) d->pci_fail = parse_error(value, line);
        else warn(line, "key", tok);
    }
}

static void parse_line(char *text, int line)
{
    char *name = NULL, *save = NULL, *kind, *uuid;
    char *hash = strchr(text, '#');
    if (hash) *hash = '\0';
    for (char *p = strstr(text, "name="); p; p = strstr(p + 1, "name="))
        if (p == text || isspace((unsigned char)p[-1])) {
            *p = '\0';
            name = p + 5;
            break;
        }
    if (name) {
        size_t n = strlen(name);
        while (n && isspace((unsigned char)name[n - 1])) name[--n] = '\0';
    }
    kind = strtok_r(text, " \t", &save);
    if (!kind) return;
    if (strcmp(kind, "init") == 0) {
        char *v = strtok_r(NULL, " \t", &save);
        cfg.init_error = v ? parse_error(v, line) : NVML_SUCCESS;
    } else if (strcmp(kind, "driver") == 0 || strcmp(kind, "nvml") == 0) {
        char *v = strtok_r(NULL, " \t", &save);
        if (v) copy_text(kind[0] == 'd' ? cfg.driver : cfg.nvml, v);
    } else if (strcmp(kind, "gpu") == 0 || strcmp(kind, "mig") == 0) {
        int parent = -1;
        if (kind[0] == 'm') {
            char *parent_uuid = strtok_r(NULL, " \t", &save);
            parent = parent_uuid ? find_device(parent_uuid) : -1;
            if (parent < 0 || cfg.devices[parent].parent >= 0) {
                warn(line, "mig line without an earlier gpu", parent_uuid ? parent_uuid : "");
                return;
            }
        }
        uuid = strtok_r(NULL, " \t", &save);
        if (!uuid || cfg.ndevices == MAX_DEVICES) {
            warn(line, "device line", kind);
            return;
        }
        char *rest = save;
        struct fake_device *d = &cfg.devices[cfg.ndevices];
        memset(d, 0, sizeof *d);
        copy_text(d->uuid, uuid);
        copy_text(d->name, name ? name : "NVIDIA Fake GPU");
        d->mig_mode = -1;
        d->parent = parent;
        if (parent < 0) {
            int gpus = 0;
            for (int i = 0; i < cfg.ndevices; i++)
                gpus += cfg.devices[i].parent < 0;
            snprintf(d->pci, TEXT, "00000000:%02X:00.0", 0x10 + gpus);
        }
        if (parent >= 0) {
            struct fake_device *p = &cfg.devices[parent];
            int children = 0;
            for (int i = 0; i < cfg.ndevices; i++)
                children += cfg.devices[i].parent == parent;
            if (children == MAX_MIG) {
                warn(line, "more than 7 MIG devices on", p->uuid);
                return;
            }
            d->mig_index = children;
            d->util_na = 1;
            if (p->mig_mode < 0) p->mig_mode = 1;
        }
        cfg.ndevices++;
        if (rest) parse_device_keys(d, rest, line);
    } else if (strcmp(kind, "proc") == 0) {
        char *dev = strtok_r(NULL, " \t", &save);
        char *pid = strtok_r(NULL, " \t", &save);
        char *used = strtok_r(NULL, " \t", &save);
        char *mode = strtok_r(NULL, " \t", &save);
        int device = dev ? find_device(dev) : -1;
        if (device < 0 || !pid || !used || cfg.nprocs == MAX_PROCS) {
            warn(line, "proc line for", dev ? dev : "");
            return;
        }
        struct fake_proc *p = &cfg.procs[cfg.nprocs++];
        p->device = device;
        p->pid = (unsigned int)strtoul(pid, NULL, 10);
        p->used = strcmp(used, "na") == 0 ? NOT_AVAILABLE_ULL : parse_size(used, line);
        p->graphics = mode && strcmp(mode, "graphics") == 0;
    } else {
        warn(line, "line kind", kind);
    }
}

static char *read_file(const char *path)
{
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return NULL;
    size_t size = 0, cap = 4096;
    char *text = malloc(cap);
    for (size_t n; text && (n = fread(text + size, 1, cap - size - 1, f)) > 0;) {
        size += n;
        if (size + 1 == cap) text = realloc(text, cap *= 2);
    }
    fclose(f);
    if (text) text[size] = '\0';
    return text;
}

/* (Re)load the configuration. Called with the lock held, at the start of every entry point. */
static void load(void)
{
    const char *path = getenv("MEMD_FAKE_NVML_CONFIG");
    char *text = read_file(path);
    int unreadable = !text;
    if (unreadable) text = strdup("init driver_not_loaded\n");
    warn_enabled = !last_text || strcmp(text, last_text) != 0;
    if (warn_enabled && unreadable && path)
        fprintf(stderr, "fakenvml: cannot read %s: acting as a driver that is not loaded\n", path);
    memset(&cfg, 0, sizeof cfg);
    copy_text(cfg.driver, "550.54.15");
    copy_text(cfg.nvml, "12.550.54.15");
    char *save, *line_text, *copy = strdup(text);
    int line = 0;
    /* strtok_r would skip empty lines and so miscount; split by hand */
    for (line_text = copy; line_text; line_text = save) {
        save = strchr(line_text, '\n');
        if (save) *save++ = '\0';
        parse_line(line_text, ++line);
    }
    free(copy);
    free(last_text);
    last_text = text;
}

/* Every entry point but init and shutdown starts with begin() (lock, reload, and Uninitialized
 * unless initialised) and returns through end() (unlock). */
static nvmlReturn_t begin(void)
{
    pthread_mutex_lock(&lock);
    load();
    return refcount > 0 && cfg.init_error == NVML_SUCCESS ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

static nvmlReturn_t end(nvmlReturn_t ret)
{
    pthread_mutex_unlock(&lock);
    return ret;
}

/* The device behind a handle, or NULL with *ret saying why (the device's injected failure). */
static struct fake_device *lookup(nvmlDevice_t handle, nvmlReturn_t *ret)
{
    if (*ret != NVML_SUCCESS) return NULL;
    long i = ((char *)handle - (char *)cfg.devices) / (long)sizeof cfg.devices[0];
    if (!handle || i < 0 || i >= cfg.ndevices || handle != &cfg.devices[i]) {
        *ret = NVML_ERROR_INVALID_ARGUMENT;
        return NULL;
    }
    *ret = cfg.devices[i].fail;
    return *ret == NVML_SUCCESS ? &cfg.devices[i] : NULL;
}

/* ---- the NVML entry points ---- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&lock);
    load();
    init_calls++;
    nvmlReturn_t ret = cfg.init_error;
    if (ret == NVML_SUCCESS) refcount++;
    pthread_mutex_unlock(&lock);
    return ret;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (refcount > 0) refcount--;
    pthread_mutex_unlock(&lock);
    return ret;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

int fakenvml_init_calls(void)
{
    pthread_mutex_lock(&lock);
    int n = init_calls;
    pthread_mutex_unlock(&lock);
    return n;
}

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src)
{
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t ret = begin();
    return end(ret ? ret : copy_out(version, length, cfg.driver));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t ret = begin();
    return end(ret ? ret : copy_out(version, length, cfg.nvml));
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlReturn_t ret = begin();
    if (ret == NVML_SUCCESS && !count) ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        *count = 0;
        for (int i = 0; i < cfg.ndevices; i++)
            *count += cfg.devices[i].parent < 0;
    }
    return end(ret);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t ret = begin();
    if (ret == NVML_SUCCESS) {
        ret = NVML_ERROR_INVALID_ARGUMENT;
        for (int i = 0, seen = 0; device && i < cfg.ndevices; i++)
            if (cfg.devices[i].parent < 0 && (unsigned int)seen++ == index) {
                *device = &cfg.devices[i];
                ret = NVML_SUCCESS;
                break;
            }
    }
    return end(ret);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    return end(d ? copy_out(name, length, d->name) : ret);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    return end(d ? copy_out(uuid, length, d->uuid) : ret);
}

/* Return through end() after stalling, outside the lock, as long as the device says. */
static nvmlReturn_t end_after_stall(nvmlReturn_t ret, unsigned int ms)
{
    pthread_mutex_unlock(&lock);
    if (ms) {
        struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
        while (nanosleep(&t, &t) != 0) {}
    }
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    if (d) ret = memory ? d->memory_fail : NVML_ERROR_INVALID_ARGUMENT;
    if (d && ret == NVML_SUCCESS) {
        memory->total = d->total;
        memory->used = d->used + d->reserved; /* v1: used includes the reservation */
        memory->free = d->total > memory->used ? d->total - memory->used : 0;
    }
    return end_after_stall(ret, d ? d->hang_ms : 0);
}

#ifndef FAKE_NO_V2
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    if (d) ret = memory ? d->memory_fail : NVML_ERROR_INVALID_ARGUMENT;
    if (d && ret == NVML_SUCCESS && memory->version != nvmlMemory_v2)
        ret = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (d && ret == NVML_SUCCESS) {
        unsigned long long taken = d->used + d->reserved;
        memory->total = d->total;
        memory->reserved = d->reserved;
        memory->used = d->used;
        memory->free = d->total > taken ? d->total - taken : 0;
    }
    return end_after_stall(ret, d ? d->hang_ms : 0);
}
#endif

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    if (d && d->util_na) ret = NVML_ERROR_NOT_SUPPORTED;
    else if (d && !utilization) ret = NVML_ERROR_INVALID_ARGUMENT;
    else if (d) {
        utilization->gpu = d->util;
        utilization->memory = d->memutil;
    }
    return end(ret);
}

/* The two-call protocol of nvmlDevice*RunningProcesses: with too small a count, say how many
 * there are (Insufficient Size, or Success when there are none). infos is an array of
 * nvmlProcessInfo_t, or of nvmlProcessInfo_v1_t when v1. */
static nvmlReturn_t processes(nvmlDevice_t device, unsigned int *count, void *infos,
                              int graphics, int v1)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    if (!d) return end(ret);
    if (d->procs_fail) return end(d->procs_fail);
    if (!count) return end(NVML_ERROR_INVALID_ARGUMENT);
    int self = (int)(d - cfg.devices);
    unsigned int n = 0;
    for (int i = 0; i < cfg.nprocs; i++)
        n += cfg.procs[i].device == self && cfg.procs[i].graphics == graphics;
    if (*count < n || (n && !infos)) {
        *count = n;
        return end(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *count = 0;
    for (int i = 0; i < cfg.nprocs; i++) {
        struct fake_proc *p = &cfg.procs[i];
        if (p->device != self || p->graphics != graphics) continue;
        if (v1) {
            nvmlProcessInfo_v1_t *info = (nvmlProcessInfo_v1_t *)infos + (*count)++;
            info->pid = p->pid;
            info->usedGpuMemory = p->used;
            continue;
        }
        nvmlProcessInfo_t *info = (nvmlProcessInfo_t *)infos + (*count)++;
        info->pid = p->pid;
        info->usedGpuMemory = p->used;
        info->gpuInstanceId = d->parent >= 0 ? (unsigned int)d->mig_index + 1 : NOT_AVAILABLE_UINT;
        info->computeInstanceId = d->parent >= 0 ? 0 : NOT_AVAILABLE_UINT;
    }
    return end(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *count,
                                                  nvmlProcessInfo_v1_t *infos)
{
    return processes(device, count, infos, 0, 1);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *count,
                                                   nvmlProcessInfo_v1_t *infos)
{
    return processes(device, count, infos, 1, 1);
}

#ifndef FAKE_NO_PROCESS_V2
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    return processes(device, count, infos, 0, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos)
{
    return processes(device, count, infos, 1, 0);
}
#endif

#ifndef FAKE_NO_V2
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    return processes(device, count, infos, 0, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos)
{
    return processes(device, count, infos, 1, 0);
}
#endif

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    if (d && d->parent >= 0) ret = NVML_ERROR_NOT_SUPPORTED;
    else if (d && d->pci_fail) ret = d->pci_fail;
    else if (d && !pci) ret = NVML_ERROR_INVALID_ARGUMENT;
    else if (d) {
        memset(pci, 0, sizeof *pci);
        snprintf(pci->busId, sizeof pci->busId, "%s", d->pci);
        snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", d->pci + (strlen(d->pci) > 12 ? 4 : 0));
        unsigned int dom = 0, bus = 0, dev = 0;
        if (sscanf(d->pci, "%x:%x:%x", &dom, &bus, &dev) == 3) {
            pci->domain = dom;
            pci->bus = bus;
            pci->device = dev;
        }
        pci->pciDeviceId = 0x233010DE;
    }
    return end(ret);
}

/* A MIG device's GPU instance id; Invalid Argument on a physical GPU, as the real library. */
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = lookup(device, &ret);
    if (d && (d->parent < 0 || !id)) ret = NVML_ERROR_INVALID_ARGUMENT;
    else if (d) *id = (unsigned int)d->mig_index + 1;
    return end(ret);
}

/* MIG mode, the MIG device count and MIG handles: Not Supported on a GPU without MIG and on a
 * MIG device itself. */
static struct fake_device *mig_capable(nvmlDevice_t device, nvmlReturn_t *ret, const void *out)
{
    struct fake_device *d = lookup(device, ret);
    if (d && d->mig_fail) *ret = d->mig_fail;
    else if (d && (d->parent >= 0 || d->mig_mode < 0)) *ret = NVML_ERROR_NOT_SUPPORTED;
    else if (d && !out) *ret = NVML_ERROR_INVALID_ARGUMENT;
    return *ret == NVML_SUCCESS ? d : NULL;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = mig_capable(device, &ret, current && pending ? current : NULL);
    if (d) *current = *pending = (unsigned int)d->mig_mode;
    return end(ret);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = mig_capable(device, &ret, count);
    if (d) *count = MAX_MIG;
    return end(ret);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig)
{
    nvmlReturn_t ret = begin();
    struct fake_device *d = mig_capable(device, &ret, mig);
    if (d && d->mig_mode != 1) ret = NVML_ERROR_NOT_SUPPORTED;
    else if (d) {
        int self = (int)(d - cfg.devices);
        ret = NVML_ERROR_NOT_FOUND;
        for (int i = 0; i < cfg.ndevices; i++)
            if (cfg.devices[i].parent == self && (unsigned int)cfg.devices[i].mig_index == index) {
                *mig = &cfg.devices[i];
                ret = NVML_SUCCESS;
            }
    }
    return end(ret);
}
