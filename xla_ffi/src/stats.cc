// Statistics: the engine's counters and gauges as "key=value" lines (ssd.stats()).
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "engine.h"

namespace ssdtrain {

void Engine::ResetStats() {
  Lock lk(mu_);
  uint64_t staging_in_use = stats_.staging_in_use;
  stats_ = Stats();
  device_stats_.clear();
  space_.ResetCounters();
  stats_.staging_in_use = stats_.staging_peak = staging_in_use;
  throttle_.write_wait_ns = 0;
  throttle_.read_wait_ns = 0;
  cache_.alloc.ResetPeak();
  tier_.alloc.ResetPeak();
  space_.ResetPeak();
  if (hooks_) hooks_->ResetStats();
}

void Engine::StagingAllocated(uint64_t bytes) {
  stats_.staging_in_use += bytes;
  stats_.staging_peak = std::max(stats_.staging_peak, stats_.staging_in_use);
}

void Engine::CountStagedLoad(const Entry& e, bool from_store) {
  if (e.tier_ == Tier::kNvme) {
    if (from_store) {
      stats_.forwarded_tensors++;
      stats_.forwarded_bytes += e.nbytes_;
    } else {
      stats_.prefetch_hits++;
    }
  }
  stats_.staging_forwarded_tensors++;
}

std::string Engine::TakeTimeline() {
  Lock lk(mu_);
  return hooks_ ? hooks_->TakeTimeline() : std::string();
}

std::string Engine::StatsString() {
  Lock lk(mu_);
  std::ostringstream o;
  auto u = [&](const char* k, uint64_t v) { o << k << '=' << v << '\n'; };
  auto d = [&](const char* k, double v) {
    char buf[64];
    snprintf(buf, sizeof buf, "%.6f", v);
    o << k << '=' << buf << '\n';
  };
  const Stats& s = stats_;
  u("bytes_written", s.bytes_written);
  u("tensors_written", s.tensors_written);
  u("bytes_read", s.bytes_read);
  u("tensors_read", s.tensors_read);
  u("disk_bytes_written", s.disk_bytes_written);
  u("disk_bytes_read", s.disk_bytes_read);
  u("disk_tensors_written", s.disk_tensors_written);
  u("disk_tensors_read", s.disk_tensors_read);
  u("write_skipped_bytes", s.write_skipped_bytes);
  u("write_skipped_tensors", s.write_skipped_tensors);
  u("forwarded_tensors", s.forwarded_tensors);
  u("forwarded_bytes", s.forwarded_bytes);
  u("staging_forwarded_tensors", s.staging_forwarded_tensors);
  u("speculative_loads", s.speculative_loads);
  u("handle_mismatches", s.handle_mismatches);
  u("staging_waits", s.staging_waits);
  u("prefetch_hits", s.prefetch_hits);
  u("prefetch_misses", s.prefetch_misses);
  u("prefetch_issued", s.prefetch_issued);
  u("disk_loaded_bytes", s.disk_loaded_bytes);
  u("disk_unused_bytes", s.disk_unused_bytes);
  u("bounce_writes", s.bounce_writes);
  u("bounce_reads", s.bounce_reads);
  u("full_kept_tensors", s.full_kept_tensors);
  u("full_kept_bytes", s.full_kept_bytes);
  u("spilled_tensors", s.spilled_tensors);
  u("spilled_bytes", s.spilled_bytes);
  u("fragmented_spills", s.fragmented_spills);
  u("fragmented_spill_bytes", s.fragmented_spill_bytes);
  u("checksum_failures", s.checksum_failures);
  u("counted_releases", s.counted_releases);
  u("unused_stores", s.unused_stores);
  u("sweeps", s.sweeps);
  u("swept_entries", s.swept_entries);
  u("revived_entries", s.revived_entries);
  u("retired_reclaimed", s.retired_reclaimed);
  u("retired_entries", retired_.size());
  u("retired_bytes", retired_bytes_);
  uint64_t uncounted = 0;
  for (const auto& [id, e] : entries_)
    uncounted += e->uses_left_ == Entry::kUncounted && !e->retired();
  u("uncounted_entries", uncounted);
  u("next_seq", next_seq_);
  d("stall_seconds", s.stall_seconds);
  d("handle_sync_seconds", s.handle_sync_seconds);
  d("write_seconds", s.write_seconds);
  d("read_seconds", s.read_seconds);
  u("host_tier_bytes_in_use", tier_.alloc.in_use());
  u("host_tier_bytes_peak", tier_.alloc.peak());
  u("host_tier_largest_free", tier_.alloc.largest_free());
  u("host_cache_bytes_in_use", cache_.alloc.in_use());
  u("host_cache_bytes_peak", cache_.alloc.peak());
  u("staging_bytes_in_use", s.staging_in_use);
  u("staging_bytes_peak", s.staging_peak);
  u("file_bytes_in_use", space_.InUse());
  u("file_bytes_peak", space_.Peak());
  u("file_bytes_allocated", space_.AllocatedBytes());
  u("file_largest_free", space_.LargestFree());
  u("live_entries", entries_.size() - retired_.size());
  u("writes_in_flight", writes_inflight_);
  u("reads_in_flight", reads_inflight_);
  u("o_direct", space_.o_direct() ? 1 : 0);
  u("gds", gds_active_ ? 1 : 0);
  u("io_threads", cfg_.io_threads);
  u("verify", cfg_.verify ? 1 : 0);
  u("on_full", cfg_.on_full);
  u("open_files", space_.files()->size());
  u("chunk_bytes", cfg_.chunk_bytes);
  u("bandwidth_cap", cfg_.bandwidth_cap);
  d("throttle_write_seconds", throttle_.write_wait_ns.load() * 1e-9);
  d("throttle_read_seconds", throttle_.read_wait_ns.load() * 1e-9);
  u("directories", space_.files()->size());
  for (size_t i = 0; i < space_.files()->size(); ++i) {
    std::string k = "file" + std::to_string(i);
    u((k + "_bytes_written").c_str(), space_.BytesWritten(i));
    u((k + "_bytes_read").c_str(), space_.BytesRead(i));
  }
  for (const auto& [dev, ds] : device_stats_) {
    std::string k = "device" + std::to_string(dev);
    u((k + "_bytes_written").c_str(), ds.bytes_written);
    u((k + "_tensors_written").c_str(), ds.tensors_written);
    u((k + "_bytes_read").c_str(), ds.bytes_read);
    u((k + "_tensors_read").c_str(), ds.tensors_read);
  }
  if (hooks_) hooks_->AppendStats(o);
  o << "backend=" << (backend_ ? backend_->name() : "none") << '\n';
  return o.str();
}

}  // namespace ssdtrain
