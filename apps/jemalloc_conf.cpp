// jemalloc options, compiled into each executable linked with jemalloc (capsnet_use_fast_malloc, via capsnet_executable_setup).
// dirty_decay_ms:-1 keeps freed pages instead of purging them: with purging, every batch-1 forward
// page-faulted oneDNN's 21 MB PrimaryCaps weight-reorder buffer back in (batch-1 latency 15.4 -> 8.9 ms,
// inference +20%; docs/kernels.md). The price is that RSS stays at its peak. $MALLOC_CONF still
// overrides this.
extern "C" {
const char* malloc_conf = "dirty_decay_ms:-1";
}
