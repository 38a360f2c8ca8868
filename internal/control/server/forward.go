package server

import (
	"net/http"
	"net/http/httputil"
	"net/url"

	"stasis/internal/storage/store"
)

// ForwardedBy is the header a node sets on a request it forwards to the
// node that drives the episode the request is about; a request that
// carries it is answered where it lands, never forwarded again.
const ForwardedBy = "Stasis-Forwarded-By"

// forward answers q on the node that drives episode row, when that is
// another node of the cluster that holds a live lease and has an address
// (serve --node-addr): the request goes there as it came, credentials
// included, and its answer comes back as it is. It reports whether it
// forwarded q. An episode whose node is gone (its lease ran out) is
// answered here.
func (s *Server) forward(w http.ResponseWriter, q *http.Request, row store.Episode) bool {
	if s.member == nil || row.Node == "" || q.Header.Get(ForwardedBy) != "" {
		return false
	}
	self := s.member.Node().Name
	if row.Node == self {
		return false
	}
	nodes, err := s.member.Store().Nodes(q.Context())
	if err != nil {
		return false // answered here: the owner's checks say the rest
	}
	var owner *store.Node
	for i, n := range nodes {
		if n.Name == row.Node && n.Live && n.Addr != "" {
			owner = &nodes[i]
		}
	}
	if owner == nil {
		return false
	}
	target, err := url.Parse(owner.Addr)
	if err != nil || (target.Scheme != "http" && target.Scheme != "https") || target.Host == "" {
		s.fail(w, q, &apiError{status: http.StatusBadGateway, typ: errNodeUnreachable,
			msg: "episode " + row.ID + " is driven by node " + row.Node + ", whose address " + owner.Addr + " is not an http(s) URL: start it with --node-addr http://HOST:PORT"})
		return true
	}
	p := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target)
			r.Out.Header.Set(ForwardedBy, self)
		},
		Transport: s.forwarder,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			s.fail(w, r, &apiError{status: http.StatusBadGateway, typ: errNodeUnreachable,
				msg: "episode " + row.ID + " is driven by node " + row.Node + " at " + owner.Addr + ", which did not answer: " + err.Error() + " (ask it there, or once its lease has run out, here)"})
		},
	}
	s.log.Debug("forwarded to the episode's node", "episode", row.ID, "node", row.Node, "addr", owner.Addr, "method", q.Method, "path", q.URL.Path)
	p.ServeHTTP(w, q)
	return true
}
