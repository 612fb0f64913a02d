// RAII owners of backend streams and events: not copyable, movable, destroyed through the
// backend that made them (on its device). A Stream may also wrap a stream owned by someone else
// (PyTorch's current stream), in which case it never destroys it.
#pragma once

#include <reviva/backend.h>
#include <reviva/export.h>

#include <functional>
#include <memory>

namespace reviva {

class Event;

class REVIVA_API Stream {
 public:
  explicit Stream(std::shared_ptr<Backend> backend,
                  StreamPriority priority = StreamPriority::Normal);
  // Wraps a stream the caller owns and keeps alive longer than this object.
  static Stream wrap(std::shared_ptr<Backend> backend, StreamHandle external);

  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  StreamHandle handle() const noexcept { return handle_; }
  Backend& backend() const noexcept { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const noexcept { return backend_; }
  bool owned() const noexcept { return owned_; }

  void synchronize() const;
  // Later work on this stream waits for `event`'s most recent record.
  void wait(const Event& event) const;
  void launch_host_func(std::function<void()> fn) const;

 private:
  Stream(std::shared_ptr<Backend> backend, StreamHandle handle, bool owned) noexcept;
  void reset() noexcept;

  std::shared_ptr<Backend> backend_;
  StreamHandle handle_ = nullptr;
  bool owned_ = false;
};

class REVIVA_API Event {
 public:
  explicit Event(std::shared_ptr<Backend> backend, bool enable_timing = false);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& stream);
  void record(StreamHandle stream);
  bool query() const;  // complete (or never recorded)
  void synchronize() const;
  bool recorded() const noexcept { return recorded_; }
  bool timing() const noexcept { return timing_; }
  EventHandle handle() const noexcept { return handle_; }
  Backend& backend() const noexcept { return *backend_; }

  // Milliseconds from `start` to `end`; both must be complete timing events.
  static float elapsed_ms(const Event& start, const Event& end);

 private:
  void reset() noexcept;

  std::shared_ptr<Backend> backend_;
  EventHandle handle_ = nullptr;
  bool timing_ = false;
  bool recorded_ = false;
};

}  // namespace reviva
