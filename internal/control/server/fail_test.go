package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/task"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// TestFailAnswersEveryKind: every typed error the layers below return,
// wrapped as they wrap it, is answered with its kind's status and type; an
// error of no kind alone is a 500.
func TestFailAnswersEveryKind(t *testing.T) {
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, c := range []struct {
		err    error
		status int
		typ    string
	}{
		{sandbox.Errorf(errdefs.ErrExpired, "exec", "sandbox sb-1", "its expiry passed"), http.StatusGone, "expired"},
		{sandbox.Errorf(errdefs.ErrNotFound, "fork", "snapshot snap-1", ""), http.StatusNotFound, "not_found"},
		{sandbox.Errorf(errdefs.ErrConflict, "pause", "sandbox sb-1", "already paused"), http.StatusConflict, "conflict"},
		{sandbox.Errorf(errdefs.ErrUnsupported, "snapshot", "", "no memory snapshots"), http.StatusNotImplemented, "unsupported"},
		{sandbox.Errorf(errdefs.ErrInvalid, "write", "/etc/../x", "a path out of the sandbox"), http.StatusBadRequest, "invalid_request"},
		{fmt.Errorf("restore: %w", sandbox.Errorf(errdefs.ErrTimeout, "exec", "", "")), http.StatusGatewayTimeout, "timeout"},
		{fmt.Errorf("checkpoint %q: %w", "c", errdefs.ErrNotFound), http.StatusNotFound, "not_found"},
		{fmt.Errorf("begin: %w", errdefs.ErrExists), http.StatusConflict, "conflict"},
		{fmt.Errorf("commit: %w", store.ErrIncomplete), http.StatusConflict, "conflict"},
		{fmt.Errorf("decode: %w", store.ErrRecord), http.StatusBadRequest, "invalid_request"},
		{fmt.Errorf("verify: %w", task.ErrNotEnded), http.StatusConflict, "conflict"},
		{fmt.Errorf("prepare: %w", coordinator.ErrStraggler), http.StatusConflict, "conflict"},
		{fmt.Errorf("restore: %w", coordinator.ErrRefused), http.StatusConflict, "conflict"},
		{coordinator.CheckStragglers("sometimes"), http.StatusBadRequest, "invalid_request"},
		{errors.New("the disk is on fire"), http.StatusInternalServerError, "internal"},
	} {
		w := httptest.NewRecorder()
		s.fail(w, httptest.NewRequest("GET", "/v1/x", nil), c.err)
		var body struct {
			Error struct{ Type, Message string } `json:"error"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
			t.Fatalf("%v: body %q: %v", c.err, w.Body, err)
		}
		if w.Code != c.status || body.Error.Type != c.typ || body.Error.Message != c.err.Error() {
			t.Errorf("%v: answered %d %s %q, want %d %s", c.err, w.Code, body.Error.Type, body.Error.Message, c.status, c.typ)
		}
	}
}
