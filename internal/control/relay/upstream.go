package relay

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// Upstream is where calls go: an http://, https:// or unix://PATH URL.
type Upstream struct {
	Raw    string // the URL as given
	Base   string // URL prefix requests are made against
	Client *http.Client
}

// ParseUpstream parses an upstream URL. unix:///run/gw.sock sends HTTP over
// that unix socket.
func ParseUpstream(raw string) (*Upstream, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("upstream %q: %w", raw, err)
	}
	tr := &http.Transport{
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 1024,
		IdleConnTimeout:     90 * time.Second,
	}
	switch u.Scheme {
	case "http", "https":
		if u.Host == "" {
			return nil, fmt.Errorf("upstream %q: no host", raw)
		}
		tr.DialContext = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
		return &Upstream{Raw: raw, Base: strings.TrimSuffix(u.Scheme+"://"+u.Host+u.Path, "/"), Client: &http.Client{Transport: tr}}, nil
	case "unix":
		path := u.Path
		if u.Host != "" { // unix://relative/path
			path = u.Host + u.Path
		}
		if path == "" {
			return nil, fmt.Errorf("upstream %q: no socket path; use unix:///path/to.sock", raw)
		}
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}
		return &Upstream{Raw: raw, Base: "http://unix", Client: &http.Client{Transport: tr}}, nil
	}
	return nil, fmt.Errorf("upstream %q: scheme must be http, https or unix", raw)
}

// maxPresize bounds the buffer a read sets aside from a Content-Length
// before any byte arrives (a client may claim any length).
const maxPresize = 1 << 20

// readAll is io.ReadAll with the buffer sized from the body's announced
// length (size; -1 when unknown), so a body is read without the copies a
// growing buffer makes.
func readAll(r io.Reader, size int64) ([]byte, error) {
	return readInto(nil, r, size)
}

// readInto is readAll appending to b[:0] (reusing its memory).
func readInto(b []byte, r io.Reader, size int64) ([]byte, error) {
	if size < 0 || size > maxPresize {
		size = 0
	}
	if want := int(size) + bytes.MinRead; cap(b) < want {
		b = make([]byte, 0, want)
	}
	b = b[:0]
	for {
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err != nil {
			if err == io.EOF {
				err = nil
			}
			return b, err
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)] // let append pick the next size
		}
	}
}

// bodies are buffers for response bodies that are not kept past their
// call: the gateway's copy of the model's answer (the ledger keeps its own
// canonical copy) and the relay's copy of the gateway's.
var bodies = sync.Pool{New: func() any { return new([]byte) }}

// maxPooledBody: larger buffers go to the garbage collector, not the pool.
const maxPooledBody = 1 << 20

// readPooled reads a body into a buffer from bodies; give the buffer back
// with releaseBody once nothing uses the bytes.
func readPooled(r io.Reader, size int64) ([]byte, *[]byte, error) {
	bp := bodies.Get().(*[]byte)
	b, err := readInto(*bp, r, size)
	*bp = b
	return b, bp, err
}

func releaseBody(bp *[]byte) {
	if bp != nil && cap(*bp) <= maxPooledBody {
		*bp = (*bp)[:0]
		bodies.Put(bp)
	}
}
