package relay

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// Upstream is where calls go: an http://, https:// or unix://PATH URL.
type Upstream struct {
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
		return &Upstream{Base: strings.TrimSuffix(u.Scheme+"://"+u.Host+u.Path, "/"), Client: &http.Client{Transport: tr}}, nil
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
		return &Upstream{Base: "http://unix", Client: &http.Client{Transport: tr}}, nil
	}
	return nil, fmt.Errorf("upstream %q: scheme must be http, https or unix", raw)
}
