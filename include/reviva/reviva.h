// Umbrella header of the Reviva core library.
#pragma once

#include <reviva/backend.h>
#include <reviva/error.h>
#include <reviva/pinned_host_pool.h>
#include <reviva/stream.h>
#include <reviva/transfer_engine.h>
#include <reviva/version.h>
