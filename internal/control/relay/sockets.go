package relay

import (
	"net"
	"net/http"
	"sync"
	"time"
)

// SandboxSockets serves a gateway on one socket per sandbox: each
// sandbox's relays reach the gateway on a socket of their own, which no
// other sandbox sees, and on it only the token of the episode bound to
// that sandbox (Gateway.Bind) is valid. It is what a provider that makes
// those sockets (the local provider's Options.Gateway) hands them to.
type SandboxSockets struct {
	handler func(sandbox string) http.Handler

	mu      sync.Mutex
	servers map[string]*http.Server
	closed  bool
}

// NewSandboxSockets serves g (Gateway.SandboxHandler); wrap, when set,
// wraps each socket's handler (tests hold calls there).
func NewSandboxSockets(g *Gateway, wrap func(http.Handler) http.Handler) *SandboxSockets {
	return NewSandboxSocketsFunc(func(sandbox string) http.Handler {
		h := g.SandboxHandler(sandbox)
		if wrap != nil {
			h = wrap(h)
		}
		return h
	})
}

// NewSandboxSocketsFunc serves each sandbox's socket with handler(id).
func NewSandboxSocketsFunc(handler func(sandbox string) http.Handler) *SandboxSockets {
	return &SandboxSockets{handler: handler, servers: map[string]*http.Server{}}
}

// ServeSandbox serves sandbox id's relays on ln until StopSandbox(id) or
// Close; a second call for id replaces the first.
func (s *SandboxSockets) ServeSandbox(id string, ln net.Listener) {
	srv := &http.Server{Handler: s.handler(id), ReadHeaderTimeout: 30 * time.Second}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = ln.Close()
		return
	}
	old := s.servers[id]
	s.servers[id] = srv
	s.mu.Unlock()
	if old != nil {
		_ = old.Close()
	}
	go func() { _ = srv.Serve(ln) }()
}

// StopSandbox stops serving sandbox id: its listener and connections are
// closed.
func (s *SandboxSockets) StopSandbox(id string) {
	s.mu.Lock()
	srv := s.servers[id]
	delete(s.servers, id)
	s.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
}

// Serving is how many sandboxes are served.
func (s *SandboxSockets) Serving() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.servers)
}

// Close stops serving every sandbox; later ServeSandbox calls close their
// listener at once.
func (s *SandboxSockets) Close() {
	s.mu.Lock()
	s.closed = true
	srvs := s.servers
	s.servers = map[string]*http.Server{}
	s.mu.Unlock()
	for _, srv := range srvs {
		_ = srv.Close()
	}
}
