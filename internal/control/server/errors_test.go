package server_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/openapi"
	"stasis/internal/control/server"
	"stasis/internal/storage/store"
)

// TestEveryRouteErrorIsTyped walks every API route's error cases (unknown
// ids, malformed and oversized bodies, bad query values, ids used before,
// wrong states) on a real server, and checks that each is answered with
// the status it names, a JSON error of the matching type, a status the
// OpenAPI document declares for the operation, and never a 500.
func TestEveryRouteErrorIsTyped(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	r := startServer(t, ctx, state, nil)
	defer r.Close()
	h := r.srv.Handler()

	do := func(method, path, body string) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		q := httptest.NewRequest(method, path, strings.NewReader(body)).WithContext(ctx)
		q.Host = "localhost"
		if method == "POST" {
			q.Header.Set("Content-Type", "application/json")
		}
		h.ServeHTTP(w, q)
		return w
	}
	// A committed checkpoint (of no episodes) to use an id of twice and
	// to delete twice.
	if w := do("POST", "/v1/checkpoints", `{"id":"ck-used"}`); w.Code != http.StatusCreated {
		t.Fatalf("an empty checkpoint: %d %s", w.Code, w.Body)
	}

	// A pending checkpoint, begun in the server's store as a save under
	// way would leave it: it neither restores, branches nor deletes.
	st, err := store.OpenSQLite(filepath.Join(state, store.FileName))
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Begin(ctx, "ck-pending", nil); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}

	big := `{"id":"` + strings.Repeat("x", server.MaxBody) + `"}`
	type errCase struct {
		method, path, body string
		status             int
	}
	cases := map[string][]errCase{
		"POST /v1/episodes": {
			{"POST", "/v1/episodes", `{"id":`, 400},
			{"POST", "/v1/episodes", `{"id":"e1","task":"mini/shell-fizzbuzz","nonsense":1}`, 400},
			{"POST", "/v1/episodes", `{"id":"../e1","task":"mini/shell-fizzbuzz"}`, 400},
			{"POST", "/v1/episodes", `{"id":"e1"}`, 400},
			{"POST", "/v1/episodes", `{"id":"e1","task":"no/such-task"}`, 400},
			{"POST", "/v1/episodes", `{"id":"e1","task":"mini/shell-fizzbuzz","harness":"nonesuch"}`, 400},
			{"POST", "/v1/episodes", big, 413},
			{"POST", "/v1/episodes", "", 400},
		},
		"GET /v1/episodes": {
			{"GET", "/v1/episodes?state=bogus", "", 400},
		},
		"GET /v1/episodes/{id}": {
			{"GET", "/v1/episodes/nobody", "", 404},
		},
		"POST /v1/episodes/{id}/verify": {
			{"POST", "/v1/episodes/nobody/verify", "", 404},
		},
		"POST /v1/episodes/{id}/retire": {
			{"POST", "/v1/episodes/nobody/retire", "", 404},
		},
		"GET /v1/episodes/{id}/ledger": {
			{"GET", "/v1/episodes/nobody/ledger", "", 404},
			{"GET", "/v1/episodes/nobody/ledger?after=-1", "", 400},
			{"GET", "/v1/episodes/nobody/ledger?limit=0", "", 400},
			{"GET", "/v1/episodes/nobody/ledger?bodies=perhaps", "", 400},
		},
		"GET /v1/episodes/{id}/ledger/verify": {
			{"GET", "/v1/episodes/nobody/ledger/verify", "", 404},
		},
		"POST /v1/checkpoints": {
			{"POST", "/v1/checkpoints", `{"id":"ck used"}`, 400},
			{"POST", "/v1/checkpoints", `{"stragglers":"sometimes"}`, 400},
			{"POST", "/v1/checkpoints", `[1]`, 400},
			{"POST", "/v1/checkpoints", `{"id":"ck-used"}`, 409},
		},
		"GET /v1/checkpoints": {
			{"GET", "/v1/checkpoints?state=bogus", "", 400},
			{"GET", "/v1/checkpoints?limit=-3", "", 400},
		},
		"GET /v1/checkpoints/{id}": {
			{"GET", "/v1/checkpoints/nothing", "", 404},
		},
		"POST /v1/checkpoints/{id}/restore": {
			{"POST", "/v1/checkpoints/nothing/restore", "", 404},
			{"POST", "/v1/checkpoints/ck-pending/restore", "", 409},
		},
		"POST /v1/checkpoints/{id}/branch": {
			{"POST", "/v1/checkpoints/nothing/branch", `{"episode":"e1","copies":1}`, 404},
			{"POST", "/v1/checkpoints/ck-used/branch", `{"episode":"nobody","copies":1}`, 404},
			{"POST", "/v1/checkpoints/ck-used/branch", `{"episode":`, 400},
			{"POST", "/v1/checkpoints/ck-pending/branch", `{"episode":"e1","copies":1}`, 409},
		},
		"DELETE /v1/checkpoints/{id}": {
			{"DELETE", "/v1/checkpoints/nothing", "", 404},
			{"DELETE", "/v1/checkpoints/ck-pending", "", 409},
		},
		// Operations with no error of their own to walk.
		"GET /v1/tasks":     nil,
		"GET /metrics":      nil,
		"GET /healthz":      nil,
		"GET /openapi.json": nil,
	}
	declared := declaredStatuses(t)
	for _, route := range r.srv.Routes() {
		op := strings.ReplaceAll(route, "...}", "}")
		list, ok := cases[op]
		if !ok {
			t.Errorf("%s: no error cases are listed for it; add them (or nil if it has none)", op)
			continue
		}
		for _, c := range list {
			w := do(c.method, c.path, c.body)
			name := c.method + " " + c.path
			if len(c.body) > 60 {
				name += " (" + strconv.Itoa(len(c.body)) + "-byte body)"
			} else if c.body != "" {
				name += " " + c.body
			}
			var e apiErr
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Type == "" || e.Error.Message == "" {
				t.Errorf("%s: %d, body %q is not a JSON error", name, w.Code, w.Body)
				continue
			}
			if w.Code >= 500 {
				t.Errorf("%s: %d %s %q", name, w.Code, e.Error.Type, e.Error.Message)
				continue
			}
			if w.Code != c.status {
				t.Errorf("%s: %d (%s: %s), want %d", name, w.Code, e.Error.Type, e.Error.Message, c.status)
			}
			if want := typeOf[w.Code]; want != "" && e.Error.Type != want {
				t.Errorf("%s: %d with type %q, want %q", name, w.Code, e.Error.Type, want)
			}
			if !declared[op][strconv.Itoa(w.Code)] {
				t.Errorf("%s: %d, which the OpenAPI document does not declare for %s", name, w.Code, op)
			}
		}
	}
	// The wrong-state cases, once the id exists: a deleted checkpoint is
	// gone (404), not an internal error.
	if w := do("DELETE", "/v1/checkpoints/ck-used", ""); w.Code != http.StatusOK && w.Code != http.StatusNoContent {
		t.Errorf("delete ck-used: %d %s", w.Code, w.Body)
	}
	if w := do("DELETE", "/v1/checkpoints/ck-used", ""); w.Code != http.StatusNotFound {
		t.Errorf("delete ck-used twice: %d %s, want 404", w.Code, w.Body)
	}
}

// typeOf is the error type each status is named by.
var typeOf = map[int]string{
	400: "invalid_request", 404: "not_found", 409: "conflict", 410: "expired",
	413: "too_large", 501: "unsupported", 503: "unavailable", 504: "timeout",
}

// declaredStatuses reads, per operation, the statuses the OpenAPI
// document declares.
func declaredStatuses(t *testing.T) map[string]map[string]bool {
	t.Helper()
	var doc struct {
		Paths map[string]map[string]struct {
			Responses map[string]json.RawMessage `json:"responses"`
		} `json:"paths"`
	}
	if err := json.Unmarshal(openapi.Raw(openapi.Server), &doc); err != nil {
		t.Fatal(err)
	}
	out := map[string]map[string]bool{}
	for path, methods := range doc.Paths {
		for m, op := range methods {
			codes := map[string]bool{}
			for c := range op.Responses {
				codes[c] = true
			}
			out[strings.ToUpper(m)+" "+path] = codes
		}
	}
	return out
}
