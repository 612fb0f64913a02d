// Umbrella header of the Reviva core library.
#pragma once

#include <reviva/arena_device_allocator.h>
#include <reviva/backend.h>
#include <reviva/checksum.h>
#include <reviva/device_allocator.h>
#include <reviva/device_arena.h>
#include <reviva/disk_file.h>
#include <reviva/disk_store.h>
#include <reviva/error.h>
#include <reviva/eviction_policy.h>
#include <reviva/host_attention.h>
#include <reviva/kv_store.h>
#include <reviva/metrics.h>
#include <reviva/offload_manager.h>
#include <reviva/pinned_host_pool.h>
#include <reviva/prefetch_scheduler.h>
#include <reviva/stream.h>
#include <reviva/transfer_engine.h>
#include <reviva/version.h>
#include <reviva/weight_store.h>
