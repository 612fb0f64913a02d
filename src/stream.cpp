// RAII streams and events over the Backend interface. Destructors only warn, never throw.
#include <reviva/error.h>
#include <reviva/stream.h>

#include <utility>

namespace reviva {

Stream::Stream(std::shared_ptr<Backend> backend, StreamPriority priority)
    : backend_(std::move(backend)) {
  REVIVA_CHECK_ARG(backend_ != nullptr, "Stream: backend is null");
  handle_ = backend_->create_stream(priority);
  owned_ = true;
}

Stream::Stream(std::shared_ptr<Backend> backend, StreamHandle handle, bool owned) noexcept
    : backend_(std::move(backend)), handle_(handle), owned_(owned) {}

Stream Stream::wrap(std::shared_ptr<Backend> backend, StreamHandle external) {
  REVIVA_CHECK_ARG(backend != nullptr, "Stream::wrap: backend is null");
  return Stream(std::move(backend), external, /*owned=*/false);
}

Stream::~Stream() { reset(); }

Stream::Stream(Stream&& other) noexcept
    : backend_(std::move(other.backend_)),
      handle_(std::exchange(other.handle_, nullptr)),
      owned_(std::exchange(other.owned_, false)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = std::move(other.backend_);
    handle_ = std::exchange(other.handle_, nullptr);
    owned_ = std::exchange(other.owned_, false);
  }
  return *this;
}

void Stream::reset() noexcept {
  if (owned_ && backend_ && handle_) backend_->destroy_stream(handle_);
  handle_ = nullptr;
  owned_ = false;
}

void Stream::synchronize() const { backend_->synchronize_stream(handle_); }

void Stream::wait(const Event& event) const {
  REVIVA_CHECK_ARG(&event.backend() == backend_.get(),
                   "Stream::wait: the event belongs to another backend");
  backend_->stream_wait_event(handle_, event.handle());
}

void Stream::launch_host_func(std::function<void()> fn) const {
  backend_->launch_host_func(handle_, std::move(fn));
}

Event::Event(std::shared_ptr<Backend> backend, bool enable_timing)
    : backend_(std::move(backend)), timing_(enable_timing) {
  REVIVA_CHECK_ARG(backend_ != nullptr, "Event: backend is null");
  handle_ = backend_->create_event(enable_timing);
}

Event::~Event() { reset(); }

Event::Event(Event&& other) noexcept
    : backend_(std::move(other.backend_)),
      handle_(std::exchange(other.handle_, nullptr)),
      timing_(other.timing_),
      recorded_(std::exchange(other.recorded_, false)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = std::move(other.backend_);
    handle_ = std::exchange(other.handle_, nullptr);
    timing_ = other.timing_;
    recorded_ = std::exchange(other.recorded_, false);
  }
  return *this;
}

void Event::reset() noexcept {
  if (backend_ && handle_) backend_->destroy_event(handle_);
  handle_ = nullptr;
  recorded_ = false;
}

void Event::record(const Stream& stream) {
  REVIVA_CHECK_ARG(&stream.backend() == backend_.get(),
                   "Event::record: the stream belongs to another backend");
  record(stream.handle());
}

void Event::record(StreamHandle stream) {
  backend_->record_event(handle_, stream);
  recorded_ = true;
}

bool Event::query() const { return backend_->query_event(handle_); }

void Event::synchronize() const { backend_->synchronize_event(handle_); }

float Event::elapsed_ms(const Event& start, const Event& end) {
  REVIVA_CHECK_ARG(start.timing_ && end.timing_,
                   "Event::elapsed_ms: both events must be created with enable_timing=true");
  REVIVA_CHECK_ARG(start.recorded_ && end.recorded_,
                   "Event::elapsed_ms: both events must have been recorded");
  return start.backend_->elapsed_ms(start.handle_, end.handle_);
}

}  // namespace reviva
