package relay

import (
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"stasis/internal/control/model"
	"stasis/internal/control/openapi"
)

// TestOpenAPIMatchesHandlers: every operation a document declares is one
// its handler routes, and the other way round; and each answers (not 404
// or 405) when called.
func TestOpenAPIMatchesHandlers(t *testing.T) {
	m := newFakeModel(t)
	g, err := OpenGateway(GatewayConfig{Upstream: m.srv.URL, State: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	tok := filepath.Join(t.TempDir(), "t.json")
	writeCreds(t, tok, Credentials{Episode: "ep", Token: "x"})
	r, err := New(Config{Upstream: m.srv.URL, TokenFile: tok})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		doc     string
		routes  []string
		handler http.Handler
	}{
		{openapi.Relay, r.Routes(), r.Handler()},
		{openapi.Gateway, g.Routes(), g.Handler()},
		{openapi.Model, nil, model.New(model.Options{}).Handler()},
	} {
		ops, err := openapi.Operations(c.doc)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, op := range ops {
			got = append(got, string(op))
		}
		// A ServeMux wildcard for the rest of a path, {name...}, is an
		// OpenAPI path parameter, {name}.
		routes := strings.ReplaceAll(strings.Join(c.routes, "\n"), "...}", "}")
		if c.routes != nil && strings.Join(got, "\n") != routes {
			t.Errorf("%s declares\n%s\nthe handler routes\n%s", c.doc, strings.Join(got, "\n"), routes)
		}
		for _, op := range ops {
			method, path, _ := strings.Cut(string(op), " ")
			path = strings.ReplaceAll(path, "{endpoint}", "completions")
			req := httptest.NewRequest(method, path, strings.NewReader(`{"messages":[]}`))
			w := httptest.NewRecorder()
			c.handler.ServeHTTP(w, req)
			if w.Code == http.StatusNotFound || w.Code == http.StatusMethodNotAllowed {
				t.Errorf("%s: %s answers %d", c.doc, op, w.Code)
			}
		}
		// An operation the document does not declare is not served.
		w := httptest.NewRecorder()
		c.handler.ServeHTTP(w, httptest.NewRequest(http.MethodDelete, "/v1/models", nil))
		if w.Code != http.StatusNotFound && w.Code != http.StatusMethodNotAllowed {
			t.Errorf("%s: an undeclared operation answered %d", c.doc, w.Code)
		}
	}
}
