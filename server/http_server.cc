#include "server/http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "wire/http_status.h"

namespace ferry::server {

namespace {

// httplib's task queue, grown a thread at a time while every thread is busy, up to a limit;
// the threads stay until shutdown, which runs what is queued first.
class Workers : public httplib::TaskQueue {
 public:
  explicit Workers(size_t max) : max_(max) {}

  void enqueue(std::function<void()> fn) override {
    absl::MutexLock l(&mu_);
    queue_.push_back(std::move(fn));
    if (idle_ < queue_.size() && threads_.size() < max_) {
      threads_.emplace_back([this] { Loop(); });
    }
  }

  void shutdown() override {
    std::vector<std::thread> threads;
    {
      absl::MutexLock l(&mu_);
      stopping_ = true;
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> fn;
      {
        absl::MutexLock l(&mu_);
        ++idle_;
        mu_.Await(absl::Condition(
            +[](Workers* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
              return !w->queue_.empty() || w->stopping_;
            },
            this));
        --idle_;
        if (queue_.empty()) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  const size_t max_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

// What OpenSSL last said went wrong.
std::string OpenSslError() {
  char text[256] = "unknown error";
  if (const unsigned long e = ERR_get_error(); e != 0) ERR_error_string_n(e, text, sizeof text);
  return text;
}

void AddressOf(int sock, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  const int r = peer ? getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len)
                     : getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len);
  if (r != 0) return;
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, serv, sizeof serv,
                  NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host;
    port = std::atoi(serv);
  }
}

}  // namespace

// One accepted connection as httplib's Stream, kept across the requests it carries, with the
// deadlines and the slow-request slots of ConnectionLimits, over TLS where the server has it.
// Used by one thread.
class HttpServer::Connection : public httplib::Stream {
 public:
  Connection(int sock, HttpServer& server) : sock_(sock), server_(server) {
    if (!server.tls_) return;
    // OpenSSL reads and writes the socket itself: non-blocking, so that it comes back to
    // Await and its deadlines instead of blocking.
    fcntl(sock_, F_SETFL, fcntl(sock_, F_GETFL) | O_NONBLOCK);
    ssl_ = SSL_new(server.tls_.get());
    if (ssl_ != nullptr) SSL_set_fd(ssl_, sock_);
  }
  ~Connection() override {
    Settle();
    if (ssl_ == nullptr) return;
    if (secured_) SSL_shutdown(ssl_);  // close_notify, not waiting for the peer's
    SSL_free(ssl_);
  }

  // TLS: the handshake, due with the first request's head. False when it fails or is late.
  bool Handshake() {
    if (!server_.tls_) return true;
    if (ssl_ == nullptr) return false;
    Begin(kHead);
    // A client speaking plain HTTP here gets told so in plain HTTP, not a handshake failure
    // it shows as an empty reply: a TLS connection starts with a handshake record (22).
    char first = 0;
    if (!Await(POLLIN) || recv(sock_, &first, 1, MSG_PEEK) != 1) return false;
    if (first != 22) {
      plain_ = true;
      return Refuse("400 Bad Request",
                    absl::InvalidArgumentError("this port speaks HTTPS: use https://"));
    }
    while (true) {
      ERR_clear_error();
      const int r = SSL_accept(ssl_);
      if (r == 1) return secured_ = true;
      if (!AwaitTls(SSL_get_error(ssl_, r))) return false;
    }
  }

  // Waits for the next request's first byte: the first request's head is due from the
  // connection's start, a later one's from its first byte, which may take up to `idle`.
  bool AwaitRequest(bool first, absl::Duration idle) {
    answered_ = false;
    if (first) {
      if (phase_ != kHead) Begin(kHead);  // else it began with the TLS handshake
      return Buffered() || Await(POLLIN);
    }
    if (!Buffered() && Poll(POLLIN, idle) <= 0) return false;
    Begin(kHead);
    return true;
  }
  // The head is in: what follows is the body, if any, then the handler and the answer.
  void BeginBody() { Begin(kBody); }
  // The answer is written: what is left of it in the buffer goes out.
  bool EndRequest() {
    const bool sent = Flush();
    Settle();
    return sent;
  }

  bool is_readable() const override {
    return Buffered() || Poll(POLLIN, server_.limits_.head_timeout) > 0;
  }
  bool is_writable() const override { return Poll(POLLOUT, server_.limits_.head_timeout) > 0; }

  ssize_t read(char* ptr, size_t size) override {
    if (closed_) return -1;
    // What was written before a read (a 100 Continue) goes before the read waits.
    if (!Flush()) return -1;
    if (begin_ == end_) {
      const bool direct = size >= sizeof buf_;
      const ssize_t n = Receive(direct ? ptr : buf_, direct ? size : sizeof buf_);
      if (n <= 0) return n;
      if (direct) {
        bytes_ += static_cast<size_t>(n);
        return n;
      }
      begin_ = 0;
      end_ = static_cast<size_t>(n);
    }
    // Counted as they are taken: bytes of the body may have come with the head.
    const size_t n = std::min(size, end_ - begin_);
    std::memcpy(ptr, buf_ + begin_, n);
    begin_ += n;
    bytes_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (closed_) return -1;
    // The answer starts with its first byte out, the handler's time before it not counted; a
    // 100 Continue goes out before the body, which is still due.
    const bool interim = size >= 12 && std::memcmp(ptr, "HTTP/1.1 100", 12) == 0;
    if (phase_ != kAnswer && !interim) Begin(kAnswer);
    answered_ = answered_ || !interim;
    // Small writes (a head, a short body) gather, to go in one segment: a head and its body
    // sent apart cost the client a second wake-up (TCP_NODELAY sends each at once).
    if (out_.size() + size <= kGather) {
      out_.append(ptr, size);
      return static_cast<ssize_t>(size);
    }
    if (!Flush()) return -1;
    const ssize_t n = Send(ptr, size);
    if (n > 0 && phase_ == kAnswer) bytes_ += static_cast<size_t>(n);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(sock_, true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(sock_, false, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  enum Phase { kIdle, kHead, kBody, kAnswer };

  // poll(2) on the socket for `events`, for up to `wait` (rounded up to a millisecond).
  int Poll(short events, absl::Duration wait) const {
    pollfd p{sock_, events, 0};
    return poll(
        &p, 1,
        static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1)))));
  }

  // Sends what write gathered. False when the connection failed or was closed for being slow.
  bool Flush() {
    size_t at = 0;
    while (at < out_.size()) {
      const ssize_t n = Send(out_.data() + at, out_.size() - at);
      if (n <= 0) {
        out_.clear();
        return false;
      }
      at += static_cast<size_t>(n);
      if (phase_ == kAnswer) bytes_ += static_cast<size_t>(n);
    }
    out_.clear();
    return !closed_;
  }

  // Bytes already read that the next read gets without the socket.
  bool Buffered() const { return begin_ != end_ || (ssl_ != nullptr && SSL_pending(ssl_) > 0); }

  // One read of up to `size` bytes, waiting for them within the phase's deadline.
  ssize_t Receive(char* ptr, size_t size) {
    while (true) {
      if (ssl_ != nullptr) {
        ERR_clear_error();
        const int n = SSL_read(ssl_, ptr, static_cast<int>(std::min<size_t>(size, INT_MAX)));
        if (n > 0) return n;
        const int e = SSL_get_error(ssl_, n);
        if (e == SSL_ERROR_ZERO_RETURN) return 0;
        if (!AwaitTls(e)) return -1;
        continue;
      }
      // The socket first: it mostly has the bytes already, and a poll before would cost a
      // system call each time.
      const ssize_t n = recv(sock_, ptr, size, MSG_DONTWAIT);
      if (n >= 0 || (errno != EINTR && errno != EAGAIN)) return n;
      if (errno == EAGAIN && !Await(POLLIN)) return -1;
    }
  }

  // One write of up to `size` bytes, waiting for room within the phase's deadline.
  ssize_t Send(const char* ptr, size_t size) {
    while (true) {
      if (ssl_ != nullptr) {
        ERR_clear_error();
        const int n = SSL_write(ssl_, ptr, static_cast<int>(std::min<size_t>(size, INT_MAX)));
        if (n > 0) return n;
        if (!AwaitTls(SSL_get_error(ssl_, n))) return -1;
        continue;
      }
      const ssize_t n = send(sock_, ptr, size, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n >= 0 || (errno != EINTR && errno != EAGAIN)) return n;
      if (errno == EAGAIN && !Await(POLLOUT)) return -1;
    }
  }

  // Waits for what OpenSSL asked for (`ssl_error`, from SSL_get_error); false for an error.
  bool AwaitTls(int ssl_error) {
    if (ssl_error == SSL_ERROR_WANT_READ) return Await(POLLIN);
    if (ssl_error == SSL_ERROR_WANT_WRITE) return Await(POLLOUT);
    return false;
  }

  void Begin(Phase phase) {
    Settle();
    phase_ = phase;
    start_ = absl::Now();
    bytes_ = 0;
  }
  // Gives back the slow slot the phase held.
  void Settle() {
    if (slow_) server_.slow_.fetch_sub(1, std::memory_order_relaxed);
    slow_ = false;
    phase_ = kIdle;
  }

  // When the phase is behind by `grace`: a head not whole after it, a body or an answer
  // that has moved fewer than min_rate bytes a second since.
  absl::Time Due(absl::Duration grace) const {
    if (phase_ == kHead) return start_ + grace;
    return start_ + grace +
           absl::Seconds(static_cast<double>(bytes_) /
                         static_cast<double>(server_.limits_.min_rate));
  }

  // Waits for `events`; false once the peer is too slow (the connection is then closed).
  bool Await(short events) {
    const ConnectionLimits& limits = server_.limits_;
    while (true) {
      const absl::Time now = absl::Now();
      const absl::Time late = Due(limits.head_timeout);
      if (now >= late) {
        return phase_ == kHead ? Close("head", "the request's head did not arrive in time")
                               : Close("rate", "the peer fell behind the minimum rate");
      }
      const absl::Time slow = Due(limits.slow_after);
      if (!slow_ && now >= slow) {
        if (server_.slow_.fetch_add(1, std::memory_order_relaxed) >= limits.max_slow) {
          server_.slow_.fetch_sub(1, std::memory_order_relaxed);
          return Close("slots", "too many slow requests at once");
        }
        slow_ = true;
      }
      const int n = Poll(events, (slow_ ? late : slow) - now);
      if (n > 0) return true;
      if (n < 0 && errno != EINTR) return false;
    }
  }

  // Closes the connection for being slow (`why`: head, rate or slots): a 408 where no answer
  // has started.
  bool Close(const char* why, const std::string& message) {
    if (server_.on_slow_close) server_.on_slow_close(why);
    return Refuse("408 Request Timeout", absl::DeadlineExceededError(message));
  }
  // Answers `error` with `status` where no answer has started, and closes the connection.
  bool Refuse(const char* status, const absl::Status& error) {
    if (!answered_) {
      const std::string body = ErrorBody(error).dump();
      const std::string out = absl::StrCat(
          "HTTP/1.1 ", status, "\r\nConnection: close\r\nContent-Type: ", kJsonContentType,
          "\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
      if (ssl_ == nullptr || plain_) {
        IgnoreResult(send(sock_, out.data(), out.size(), MSG_DONTWAIT | MSG_NOSIGNAL));
      } else if (secured_) {  // once, as far as the socket takes it
        IgnoreResult(SSL_write(ssl_, out.data(), static_cast<int>(out.size())));
      }
    }
    closed_ = true;
    // A lingering close: what the peer still sends is read and dropped for a moment, so that
    // closing with it unread does not reset the connection before the peer has read the answer.
    ::shutdown(sock_, SHUT_WR);
    const absl::Time end = absl::Now() + kLinger;
    for (absl::Time now = absl::Now(); now < end; now = absl::Now()) {
      if (Poll(POLLIN, end - now) <= 0 || recv(sock_, buf_, sizeof buf_, MSG_DONTWAIT) <= 0) break;
    }
    return false;
  }
  static constexpr absl::Duration kLinger = absl::Milliseconds(500);
  static constexpr size_t kGather = 16384;  // bytes of small writes sent together
  static void IgnoreResult(ssize_t) {}

  const int sock_;
  HttpServer& server_;
  Phase phase_ = kIdle;
  absl::Time start_;
  size_t bytes_ = 0;       // moved in this phase
  bool slow_ = false;      // holds one of the server's slow slots
  bool plain_ = false;     // a plain HTTP client on the TLS port
  bool answered_ = false;  // bytes of an answer went out on this request
  bool closed_ = false;
  SSL* ssl_ = nullptr;    // with TLS
  bool secured_ = false;  // its handshake is done
  char buf_[16384];
  size_t begin_ = 0, end_ = 0;
  std::string out_;  // written, not sent yet (kGather)
};

namespace {
ConnectionLimits Checked(ConnectionLimits limits) {
  limits.slow_after = std::min(limits.slow_after, limits.head_timeout / 2);
  limits.min_rate = std::max<size_t>(limits.min_rate, 1);
  return limits;
}
}  // namespace

HttpServer::HttpServer(const ConnectionLimits& limits) : limits_(Checked(limits)) {
  new_task_queue = [max = limits.max_workers] { return new Workers(max); };
}

int HttpServer::Bind(const std::string& host, int port) {
  const int bound = port == 0 ? bind_to_any_port(host) : (bind_to_port(host, port) ? port : -1);
  // httplib listens with a backlog of 5: connections beyond it wait a second for their SYN to
  // be sent again. Listening again widens it.
  if (bound >= 0) ::listen(svr_sock_, SOMAXCONN);
  return bound;
}

void HttpServer::TlsContextFree::operator()(ssl_ctx_st* ctx) const { SSL_CTX_free(ctx); }

absl::Status HttpServer::UseTls(const std::string& cert_file, const std::string& key_file) {
  std::unique_ptr<SSL_CTX, TlsContextFree> ctx(SSL_CTX_new(TLS_server_method()));
  if (!ctx) return absl::InternalError("TLS: " + OpenSslError());
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: cannot use the certificate in ", cert_file, ": ", OpenSslError()));
  }
  // Checked against the certificate as it is loaded.
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: cannot use the private key in ", key_file, ": ", OpenSslError()));
  }
  tls_ = std::move(ctx);
  return absl::OkStatus();
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  bool ok = false;
  {
    Connection c(sock, *this);
    const size_t most = c.Handshake() ? keep_alive_max_count_ : 0;
    for (size_t left = most; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
      if (!c.AwaitRequest(left == most, absl::Seconds(keep_alive_timeout_sec_))) {
        break;
      }
      bool closed = false;
      ok = process_request(c, left == 1, closed, [&c](httplib::Request&) { c.BeginBody(); });
      ok = c.EndRequest() && ok;
      if (!ok || closed) break;
    }
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

}  // namespace ferry::server
