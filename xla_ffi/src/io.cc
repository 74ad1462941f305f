// I/O scheduling: write-behind of stored entries (pieces on the I/O threads), reads into the
// host cache (on demand, or ahead of the loads in reverse store order), synchronous bounce
// I/O for tensors that get no cache buffer, busy-time accounting, and draining (Flush).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>

#include "engine.h"

namespace ssdtrain {

void Engine::EnqueueWrite(const EntryPtr& e) {
  const std::vector<FileSpace::Piece> pieces = space_.Pieces(e->file_off_, e->padded_);
  e->w_ = WState::kQueued;
  e->w_pending_ = static_cast<int>(pieces.size());
  e->w_io_left_ = static_cast<int>(pieces.size());
  writes_inflight_++;
  for (const FileSpace::Piece& p : pieces) pool_->Submit([this, e, p] { WritePiece(e, p); }, false);
}

void Engine::WritePiece(const EntryPtr& e, const FileSpace::Piece& p) {
  const size_t file = p.file;
  const uint64_t foff = p.file_off, boff = p.buf_off, len = p.len;
  {
    Lock lk(mu_);
    if (e->w_ == WState::kCancelled) {
      if (--e->w_pending_ == 0) cv_.notify_all();  // WriteBackForwarded may wait for this
      return;
    }
    if (e->w_ == WState::kQueued) e->w_ = WState::kRunning;
    BusyBegin(true);
  }
  Status s;
  if (hooks_ && e->dev_) s = hooks_->WaitHostReady(*e);
  if (s.ok()) s = backend_->Write(file, e->host_ptr_ + boff, len, foff);
  // The last piece checksums the host copy (device stores: the bytes exist only now).
  if (e->w_io_left_.fetch_sub(1) == 1 && cfg_.verify && !e->crc_set_ && s.ok()) {
    e->crc_ = Crc32c(0, e->host_ptr_, e->nbytes_);
    e->crc_set_ = true;
  }
  Lock lk(mu_);
  BusyEnd(true);
  if (s.ok()) space_.CountIo(true, file, len);
  if (!s.ok() && e->error_.ok())
    e->error_ = s.With("asynchronous write of " + DescribeTag(e->name_, e->site_, e->id_));
  if (--e->w_pending_ == 0) FinishWrite(e);
}

void Engine::FinishWrite(const EntryPtr& e) {
  writes_inflight_--;
  if (!e->error_.ok()) {
    e->w_ = WState::kFailed;
    if (pending_error_.ok()) pending_error_ = e->error_;
    FreeHostBuffer(*e);
    if (e->has_slot_) {
      space_.Free(e->file_off_, e->padded_);
      e->has_slot_ = false;
    }
  } else {
    e->w_ = WState::kDone;
    stats_.disk_bytes_written += e->nbytes_;
    stats_.disk_tensors_written++;
    // Without forwarding, loads read the file: drop the store's copy once it is written.
    if (!cfg_.forwarding && e->tier_ == Tier::kNvme && e->host_from_store() && e->pins_ == 0)
      FreeHostBuffer(*e);
  }
  MaybeFree(e);
  cv_.notify_all();
}

void Engine::StartRead(const EntryPtr& e, bool demand) {
  const std::vector<FileSpace::Piece> pieces = space_.Pieces(e->file_off_, e->padded_);
  e->host_ = HostCopy::kReading;  // from kNone: no load or read-ahead reads a valid copy again
  e->r_status_ = Status();
  e->r_pending_ = static_cast<int>(pieces.size());
  e->r_io_left_ = static_cast<int>(pieces.size());
  reads_inflight_++;
  for (const FileSpace::Piece& p : pieces) pool_->Submit([this, e, p] { ReadPiece(e, p); }, demand);
}

void Engine::ReadPiece(const EntryPtr& e, const FileSpace::Piece& p) {
  const size_t file = p.file;
  const uint64_t foff = p.file_off, boff = p.buf_off, len = p.len;
  {
    Lock lk(mu_);
    BusyBegin(false);
  }
  Status s = backend_->Read(file, e->host_ptr_ + boff, len, foff);
  Status c;  // the last piece verifies the whole tensor
  if (e->r_io_left_.fetch_sub(1) == 1) c = CheckCrc(*e, e->host_ptr_);
  Lock lk(mu_);
  BusyEnd(false);
  if (s.ok()) space_.CountIo(false, file, len);
  if (!s.ok() && e->r_status_.ok())
    e->r_status_ = s.With("read of " + DescribeTag(e->name_, e->site_, e->id_));
  if (!c.ok()) {
    stats_.checksum_failures++;
    if (e->r_status_.ok()) e->r_status_ = c;
  }
  if (--e->r_pending_ == 0) FinishRead(e);
}

void Engine::FinishRead(const EntryPtr& e) {
  reads_inflight_--;
  if (e->r_status_.ok()) {
    e->host_ = HostCopy::kRead;
    stats_.disk_bytes_read += e->nbytes_;
    stats_.disk_tensors_read++;
  } else {
    e->host_ = HostCopy::kNone;
    FreeHostBuffer(*e);
  }
  MaybeFree(e);
  cv_.notify_all();
}

Status Engine::CheckCrc(const Entry& e, const char* buf) {
  if (!cfg_.verify || !e.crc_set_ || e.nbytes_ == 0) return Status::Ok();
  uint32_t got = Crc32c(0, buf, e.nbytes_);
  if (got == e.crc_) return Status::Ok();
  char hex[64];
  snprintf(hex, sizeof hex, "crc32c 0x%08x read, 0x%08x written", got, e.crc_);
  return Status(EIO, "checksum mismatch reading " + DescribeTag(e.name_, e.site_, e.id_) + ": " +
                         hex + " (" + std::to_string(e.nbytes_) + " bytes at store offset " +
                         std::to_string(e.file_off_) +
                         "); the store file was modified or the "
                         "disk returned bad data");
}

Status Engine::SyncIo(bool write, char* buf, uint64_t loff, uint64_t len) {
  struct Latch {
    std::mutex m;
    std::condition_variable c;
    int left = 0;
    Status st;
  };
  auto latch = std::make_shared<Latch>();
  const std::vector<FileSpace::Piece> pieces = space_.Pieces(loff, len);
  latch->left = static_cast<int>(pieces.size());
  for (const FileSpace::Piece& p : pieces) {
    pool_->Submit(
        [this, latch, write, buf, f = p.file, foff = p.file_off, boff = p.buf_off, plen = p.len] {
          {
            Lock lk(mu_);
            BusyBegin(write);
          }
          Status s = write ? backend_->Write(f, buf + boff, plen, foff)
                           : backend_->Read(f, buf + boff, plen, foff);
          {
            Lock lk(mu_);
            BusyEnd(write);
            if (s.ok()) space_.CountIo(write, f, plen);
          }
          std::lock_guard<std::mutex> g(latch->m);
          if (!s.ok() && latch->st.ok()) latch->st = s;
          if (--latch->left == 0) latch->c.notify_all();
        },
        true);
  }
  std::unique_lock<std::mutex> g(latch->m);
  latch->c.wait(g, [&] { return latch->left == 0; });
  return latch->st;
}

void Engine::BusyBegin(bool write) {
  if (active_[write]++ == 0) busy_since_[write] = Clock::now();
}

void Engine::BusyEnd(bool write) {
  if (--active_[write] == 0) {
    double s = Seconds(busy_since_[write], Clock::now());
    (write ? stats_.write_seconds : stats_.read_seconds) += s;
  }
}

std::vector<EntryPtr> Engine::PredictNext(uint64_t budget, int device, const Entry* after,
                                          bool stream) {
  std::vector<EntryPtr> out;
  auto take = [&](const EntryPtr& e) {  // false: the budget is spent
    if (device >= 0 && e->device_ != device) return true;
    if (e->padded_ > budget) return false;
    budget -= e->padded_;
    out.push_back(e);
    return true;
  };
  if (stream) {
    auto src = stream_sources_.find(device);
    if (src == stream_sources_.end()) return out;
    std::vector<std::vector<const Entry*>> sites;
    size_t longest = 0;
    for (const auto& [key, c] : src->second.sites) {
      sites.push_back(StreamAhead(device, key.first, c));
      std::sort(sites.back().begin(), sites.back().end(),
                [&c = c](const Entry* a, const Entry* b) { return c.Nearer(a, b); });
      longest = std::max(longest, sites.back().size());
    }
    for (size_t k = 0; k < longest; k++)  // every site's next entry, then every site's second...
      for (const auto& ahead : sites)
        if (k < ahead.size() && !take(entries_.at(ahead[k]->id_))) return out;
    return out;
  }
  if (after) {
    for (auto it = unloaded_.upper_bound(after->seq_); it != unloaded_.end(); ++it) {
      if (it->second->run_id_ != after->run_id_) break;  // a later execution's entries
      if (!take(it->second)) break;
    }
    return out;
  }
  for (auto it = unloaded_.rbegin(); it != unloaded_.rend(); ++it)
    if (!take(it->second)) break;
  return out;
}

// Never costs a second read of anything: it only takes room EvictOne may take (loaded or older
// entries, never a read no load has taken yet, its own earlier fetches included), and stops at
// the first entry it cannot place instead of making room some other way.
void Engine::SchedulePrefetch(Lock& lk, int device, const Entry* after, bool stream) {
  if (cfg_.prefetch_bytes == 0) return;
  for (const EntryPtr& e : PredictNext(cfg_.prefetch_bytes, device, after, stream)) {
    if (e->host_ptr_ || e->reading() || e->filling() || e->w_ != WState::kDone) continue;
    if (e->padded_ > cache_.size) continue;
    if (hooks_ && e->dev_ && hooks_->HasDeviceCopy(*e)) continue;  // its load reads no host copy
    uint64_t off;
    bool ok = false;
    for (;;) {
      if (AllocHost(Arena::kCache, e->padded_, &off)) {
        ok = true;
        break;
      }
      if (!EvictOne(e.get(), e->seq_)) break;
    }
    if (!ok) break;
    e->host_arena_ = Arena::kCache;
    e->host_off_ = off;
    e->host_ptr_ = cache_.base + off;
    stats_.prefetch_issued++;
    StartRead(e, false);
  }
}

Status Engine::Flush() {
  Lock lk(mu_);
  if (hooks_) hooks_->ReclaimReleases(true);
  cv_.wait(lk, [&] { return reads_inflight_ == 0 && writes_inflight_ == 0; });
  return TakePendingError();
}

}  // namespace ssdtrain
