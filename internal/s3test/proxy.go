package s3test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy is an in-process reverse proxy in front of a Server that injects
// faults into the requests they match: a delay, a failure (an S3 error
// answer), or a connection cut before the answer or inside its body. It
// keeps the Host a client signed, so signatures hold through it.
type Proxy struct {
	// URL is the proxy's endpoint, http://127.0.0.1:PORT.
	URL string

	srv     *httptest.Server
	tr      *http.Transport
	closing chan struct{} // closed by Close: delayed requests end
	once    sync.Once

	mu     sync.Mutex
	faults []*Fault
	reqs   []string
}

// Fault is what a Proxy does to the requests it matches.
type Fault struct {
	// Match chooses the requests (nil: all); see Matching.
	Match func(*http.Request) bool
	// Times is how many matching requests it hits (0: all of them).
	Times int
	// Delay holds a request this long before the rest (or until its
	// client gives up).
	Delay time.Duration
	// Status, if set, is answered instead of forwarding, with an S3 error
	// body (InternalError for 500, SlowDown for 503).
	Status int
	// Drop cuts the connection: before any answer when DropAfter is 0,
	// else after DropAfter bytes of the answer's body.
	Drop      bool
	DropAfter int64

	hits atomic.Int64
}

// Hits is how many requests the fault has hit.
func (f *Fault) Hits() int { return int(f.hits.Load()) }

// Matching matches requests by method ("" for any) and by a substring of
// the path and query ("" for any).
func Matching(method, contains string) func(*http.Request) bool {
	return func(r *http.Request) bool {
		return (method == "" || r.Method == method) && strings.Contains(r.URL.RequestURI(), contains)
	}
}

// Proxy starts a proxy in front of s, closed when t ends.
func (s *Server) Proxy(t testing.TB) *Proxy {
	t.Helper()
	target, err := url.Parse(s.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{tr: &http.Transport{MaxIdleConnsPerHost: 64}, closing: make(chan struct{})}
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target)
			r.Out.Host = r.In.Host // as signed
		},
		Transport: p.tr,
		ErrorLog:  log.New(io.Discard, "", 0),
	}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.serve(w, r, rp)
	}))
	p.URL = p.srv.URL
	t.Cleanup(p.Close)
	return p
}

// Close stops the proxy; requests it is delaying end with their
// connections cut.
func (p *Proxy) Close() {
	p.once.Do(func() {
		close(p.closing)
		p.srv.CloseClientConnections()
		p.srv.Close()
		p.tr.CloseIdleConnections()
	})
}

// Inject adds a fault; the first fault that matches a request (and has
// hits left) applies.
func (p *Proxy) Inject(f *Fault) *Fault {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults = append(p.faults, f)
	return f
}

// Clear removes every fault.
func (p *Proxy) Clear() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults = nil
}

// Requests lists the requests seen so far, "METHOD /PATH?QUERY".
func (p *Proxy) Requests() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.reqs...)
}

func (p *Proxy) fault(r *http.Request) *Fault {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reqs = append(p.reqs, r.Method+" "+r.URL.RequestURI())
	for _, f := range p.faults {
		if f.Match != nil && !f.Match(r) {
			continue
		}
		if n := f.hits.Add(1); f.Times > 0 && n > int64(f.Times) {
			f.hits.Add(-1)
			continue
		}
		return f
	}
	return nil
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request, rp *httputil.ReverseProxy) {
	f := p.fault(r)
	if f == nil {
		rp.ServeHTTP(w, r)
		return
	}
	if f.Delay > 0 {
		t := time.NewTimer(f.Delay)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		case <-p.closing:
			t.Stop()
			panic(http.ErrAbortHandler)
		}
	}
	switch {
	case f.Status != 0:
		code := "InternalError"
		if f.Status == http.StatusServiceUnavailable {
			code = "SlowDown"
		}
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(f.Status)
		fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>injected by s3test</Message><Resource>%s</Resource><RequestId>s3test</RequestId></Error>`, code, r.URL.Path)
	case f.Drop && f.DropAfter <= 0:
		if hj, ok := w.(http.Hijacker); ok {
			if c, _, err := hj.Hijack(); err == nil {
				c.Close()
				return
			}
		}
		panic(http.ErrAbortHandler)
	case f.Drop:
		rp.ServeHTTP(&cutWriter{ResponseWriter: w, left: f.DropAfter}, r)
	default:
		rp.ServeHTTP(w, r)
	}
}

// cutWriter passes on left bytes of a body, then cuts the connection.
type cutWriter struct {
	http.ResponseWriter
	left int64
}

func (c *cutWriter) Write(b []byte) (int, error) {
	if int64(len(b)) < c.left {
		c.left -= int64(len(b))
		return c.ResponseWriter.Write(b)
	}
	_, _ = c.ResponseWriter.Write(b[:c.left])
	c.left = 0
	if fl, ok := c.ResponseWriter.(http.Flusher); ok {
		fl.Flush()
	}
	panic(http.ErrAbortHandler) // the server closes the connection
}
