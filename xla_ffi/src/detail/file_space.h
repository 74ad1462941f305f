// The store's files and the space in them. One unlinked (private) file per store directory,
// O_DIRECT where the filesystem allows it, grown lazily up to its share of capacity_bytes.
// Logical offsets: one first-fit allocator per device group (one in all without
// device_groups); group g owns [g * span, (g + 1) * span). A logical extent is striped in
// chunk_bytes pieces round-robin over the group's files (directories g, g + G, g + 2G, ...).
// It knows nothing of entries: the engine asks it for slots, pieces and room. Not
// thread-safe (the engine's mutex), except Pieces()/ForEachPiece(), which read the layout only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.h"
#include "detail/host_memory.h"
#include "io_backend.h"
#include "status.h"

namespace ssdtrain {

class FileSpace {
 public:
  // One I/O request: `len` bytes at `file_off` of file `file`, `buf_off` into the buffer.
  struct Piece {
    size_t file;
    uint64_t file_off, buf_off, len;
  };

  Status Open(const Config& cfg);  // creates the directories' files and the allocators
  void Close();                    // closes (and so deletes) the files
  ~FileSpace() { Close(); }

  const std::vector<StoreFile>* files() const { return &files_; }
  bool o_direct() const { return o_direct_; }
  size_t groups() const { return slots_.size(); }

  // A slot of `len` bytes for a tensor of `device` (logical offset in `*off`).
  bool Alloc(int device, uint64_t len, uint64_t* off);
  void Free(uint64_t off, uint64_t len);
  const RangeAllocator& Group(int device) const { return slots_[GroupOf(device)]; }
  uint64_t InUse() const;
  uint64_t LargestFree() const;  // the largest free extent of any device group
  uint64_t Peak() const;
  void ResetPeak();
  // Grows the files so that the extent [loff, loff + len) exists on disk (ENOSPC & co).
  Status Reserve(uint64_t loff, uint64_t len);
  std::vector<Piece> Pieces(uint64_t loff, uint64_t len) const;

  // Per-file byte counters (statistics).
  void CountIo(bool write, size_t file, uint64_t len);
  uint64_t BytesWritten(size_t file) const { return file < written_.size() ? written_[file] : 0; }
  uint64_t BytesRead(size_t file) const { return file < read_.size() ? read_[file] : 0; }
  void ResetCounters();
  uint64_t AllocatedBytes() const;

  // Test hooks: cut every file to `size` bytes; flip one byte at a logical offset.
  Status DebugTruncate(uint64_t size);
  Status DebugCorrupt(uint64_t loff);
  std::string Paths() const;

 private:
  Status OpenFiles();
  size_t GroupOf(int device) const;
  Config cfg_;
  std::vector<StoreFile> files_;
  std::vector<RangeAllocator> slots_;
  uint64_t group_span_ = 0;
  bool o_direct_ = false;
  std::vector<uint64_t> written_, read_;
};

}  // namespace ssdtrain
