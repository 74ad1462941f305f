// I/O scheduling: write-behind of stored entries (pieces on the I/O threads), reads into the
// host cache (on demand, or ahead of the loads in reverse store order), synchronous bounce
// I/O for tensors that get no cache buffer, busy-time accounting, and draining (Flush).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>

#include "ssdtrain/engine.h"

namespace ssdtrain {

void Engine::EnqueueWrite(const EntryPtr& e) {
  const std::vector<FileSpace::Piece> pieces = space_.Pieces(e->file_off, e->padded);
  e->w = WState::kQueued;
  e->w_pending = static_cast<int>(pieces.size());
  e->w_io_left = static_cast<int>(pieces.size());
  writes_inflight_++;
  for (const FileSpace::Piece& p : pieces) pool_->Submit([this, e, p] { WritePiece(e, p); }, false);
}

void Engine::WritePiece(const EntryPtr& e, const FileSpace::Piece& p) {
  const size_t file = p.file;
  const uint64_t foff = p.file_off, boff = p.buf_off, len = p.len;
  {
    Lock lk(mu);
    if (e->w == WState::kCancelled) {
      if (--e->w_pending == 0) cv.notify_all();  // WriteBackOne may wait for this
      return;
    }
    if (e->w == WState::kQueued) e->w = WState::kRunning;
    BusyBegin(true);
  }
  Status s;
  if (hooks_ && e->dev) s = hooks_->WaitHostReady(*e);
  if (s.ok()) s = backend_->Write(file, e->host_ptr + boff, len, foff);
  // The last piece checksums the host copy (device stores: the bytes exist only now).
  if (e->w_io_left.fetch_sub(1) == 1 && cfg_.verify && !e->crc_set && s.ok()) {
    e->crc = Crc32c(0, e->host_ptr, e->nbytes);
    e->crc_set = true;
  }
  Lock lk(mu);
  BusyEnd(true);
  if (s.ok()) space_.CountIo(true, file, len);
  if (!s.ok() && e->error.ok())
    e->error = s.With("asynchronous write of " + DescribeTag(e->name, e->site, e->id));
  if (--e->w_pending == 0) FinishWrite(e);
}

void Engine::FinishWrite(const EntryPtr& e) {
  writes_inflight_--;
  if (!e->error.ok()) {
    e->w = WState::kFailed;
    if (pending_error_.ok()) pending_error_ = e->error;
    FreeHostBuffer(*e);
    if (e->has_slot) {
      space_.Free(e->file_off, e->padded);
      e->has_slot = false;
    }
  } else {
    e->w = WState::kDone;
    stats.disk_bytes_written += e->nbytes;
    stats.disk_tensors_written++;
    // Without forwarding, loads read the file: drop the store's copy once it is written.
    if (!cfg_.forwarding && e->tier == Tier::kNvme && e->host_from_store && e->pins == 0)
      FreeHostBuffer(*e);
  }
  MaybeFree(e);
  cv.notify_all();
}

void Engine::StartRead(const EntryPtr& e, bool demand) {
  const std::vector<FileSpace::Piece> pieces = space_.Pieces(e->file_off, e->padded);
  e->reading = true;
  e->r_status = Status();
  e->r_pending = static_cast<int>(pieces.size());
  e->r_io_left = static_cast<int>(pieces.size());
  reads_inflight_++;
  for (const FileSpace::Piece& p : pieces) pool_->Submit([this, e, p] { ReadPiece(e, p); }, demand);
}

void Engine::ReadPiece(const EntryPtr& e, const FileSpace::Piece& p) {
  const size_t file = p.file;
  const uint64_t foff = p.file_off, boff = p.buf_off, len = p.len;
  {
    Lock lk(mu);
    BusyBegin(false);
  }
  Status s = backend_->Read(file, e->host_ptr + boff, len, foff);
  Status c;  // the last piece verifies the whole tensor
  if (e->r_io_left.fetch_sub(1) == 1) c = CheckCrc(*e, e->host_ptr);
  Lock lk(mu);
  BusyEnd(false);
  if (s.ok()) space_.CountIo(false, file, len);
  if (!s.ok() && e->r_status.ok())
    e->r_status = s.With("read of " + DescribeTag(e->name, e->site, e->id));
  if (!c.ok()) {
    stats.checksum_failures++;
    if (e->r_status.ok()) e->r_status = c;
  }
  if (--e->r_pending == 0) FinishRead(e);
}

void Engine::FinishRead(const EntryPtr& e) {
  e->reading = false;
  reads_inflight_--;
  if (e->r_status.ok()) {
    e->host_valid = true;
    e->host_from_store = false;
    e->unconsumed_read = true;
    stats.disk_bytes_read += e->nbytes;
    stats.disk_tensors_read++;
  } else {
    FreeHostBuffer(*e);
  }
  MaybeFree(e);
  cv.notify_all();
}

Status Engine::CheckCrc(const Entry& e, const char* buf) {
  if (!cfg_.verify || !e.crc_set || e.nbytes == 0) return Status::Ok();
  uint32_t got = Crc32c(0, buf, e.nbytes);
  if (got == e.crc) return Status::Ok();
  char hex[64];
  snprintf(hex, sizeof hex, "crc32c 0x%08x read, 0x%08x written", got, e.crc);
  return Status(EIO, "checksum mismatch reading " + DescribeTag(e.name, e.site, e.id) + ": " + hex +
                         " (" + std::to_string(e.nbytes) + " bytes at store offset " +
                         std::to_string(e.file_off) +
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
            Lock lk(mu);
            BusyBegin(write);
          }
          Status s = write ? backend_->Write(f, buf + boff, plen, foff)
                           : backend_->Read(f, buf + boff, plen, foff);
          {
            Lock lk(mu);
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
    (write ? stats.write_seconds : stats.read_seconds) += s;
  }
}

std::vector<EntryPtr> Engine::PredictNext(uint64_t budget, int device) {
  std::vector<EntryPtr> out;
  for (auto it = unloaded_.rbegin(); it != unloaded_.rend(); ++it) {
    const EntryPtr& e = it->second;
    if (device >= 0 && e->device != device) continue;
    if (e->padded > budget) break;
    budget -= e->padded;
    out.push_back(e);
  }
  return out;
}

// Never costs a second read of anything: it only takes room EvictOne may take (loaded or older
// entries, never a read no load has taken yet, its own earlier fetches included), and stops at
// the first entry it cannot place instead of making room some other way.
void Engine::SchedulePrefetch(Lock& lk, int device) {
  if (cfg_.prefetch_bytes == 0) return;
  for (const EntryPtr& e : PredictNext(cfg_.prefetch_bytes, device)) {
    if (e->host_ptr || e->reading || e->filling || e->w != WState::kDone) continue;
    if (e->padded > cache_.size) continue;
    if (hooks_ && e->dev && hooks_->HasDeviceCopy(*e)) continue;  // its load reads no host copy
    uint64_t off;
    bool ok = false;
    for (;;) {
      if (AllocHost(Arena::kCache, e->padded, &off)) {
        ok = true;
        break;
      }
      if (!EvictOne(e.get(), e->seq)) break;
    }
    if (!ok) break;
    e->host_arena = Arena::kCache;
    e->host_off = off;
    e->host_ptr = cache_.base + off;
    stats.prefetch_issued++;
    StartRead(e, false);
  }
}

Status Engine::Flush() {
  Lock lk(mu);
  if (hooks_) hooks_->ReclaimReleases(true);
  cv.wait(lk, [&] { return reads_inflight_ == 0 && writes_inflight_ == 0; });
  return TakePendingError();
}

}  // namespace ssdtrain
