// jemalloc options, compiled into each executable linked with jemalloc (capsnet_use_fast_malloc, via capsnet_executable_setup).
// dirty_decay_ms:-1 keeps freed pages instead of purging them: with purging, every batch-1 forward
// page-faulted oneDNN's 21 MB PrimaryCaps weight-reorder buffer back in (batch-1 latency 15.4 -> 8.9 ms,
// inference +20%; docs/kernels.md). The price is that RSS stays at its peak.
// oversize_threshold:0 keeps allocations over 8 MB in the ordinary arenas instead of a dedicated one:
// the training step frees 10-47 MB spectra whose pages its 2-8 MB buffers could not reuse across
// arenas (training peak fp32 455 -> 422 MB, bf16 393 -> 382 MB, the same speed; docs/kernels.md).
// Test build.jemalloc_options reads both back. $MALLOC_CONF still overrides them.
extern "C" {
const char* malloc_conf = "dirty_decay_ms:-1,oversize_threshold:0";
}
