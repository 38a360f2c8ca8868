package errdefs

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"testing"
)

// refusal is a type of another package's that says its kind by Is.
type refusal struct{ cause error }

func (r *refusal) Error() string        { return "refused: " + r.cause.Error() }
func (r *refusal) Is(target error) bool { return target == ErrConflict }
func (r *refusal) Unwrap() error        { return r.cause }

func TestMapping(t *testing.T) {
	for _, c := range []struct {
		name   string
		err    error
		kind   error
		status int
		code   string
		exit   int
	}{
		{"nil", nil, nil, http.StatusOK, CodeInternal, 0},
		{"no kind", errors.New("disk on fire"), nil, http.StatusInternalServerError, CodeInternal, ExitFailure},
		{"not found, wrapped", fmt.Errorf("checkpoint %q: %w", "c1", ErrNotFound), ErrNotFound, http.StatusNotFound, "not_found", ExitMissing},
		{"exists", fmt.Errorf("begin: %w", ErrExists), ErrExists, http.StatusConflict, "conflict", ExitRefused},
		{"conflict", ErrConflict, ErrConflict, http.StatusConflict, "conflict", ExitRefused},
		{"invalid", Errorf(ErrInvalid, "--limit %d: use a positive number", -1), ErrInvalid, http.StatusBadRequest, "invalid_request", ExitRefused},
		{"unsupported", ErrUnsupported, ErrUnsupported, http.StatusNotImplemented, "unsupported", ExitRefused},
		{"expired", fmt.Errorf("exec: %w", ErrExpired), ErrExpired, http.StatusGone, "expired", ExitMissing},
		{"timeout", ErrTimeout, ErrTimeout, http.StatusGatewayTimeout, "timeout", ExitFailure},
		{"unavailable", ErrUnavailable, ErrUnavailable, http.StatusServiceUnavailable, "unavailable", ExitFailure},
		// The outermost kind names the error: a refusal caused by a
		// missing snapshot is a conflict, not a not-found.
		{"outermost wins", &refusal{fmt.Errorf("snapshot: %w", ErrNotFound)}, ErrConflict, http.StatusConflict, "conflict", ExitRefused},
		{"joined", errors.Join(errors.New("first"), fmt.Errorf("second: %w", ErrTimeout)), ErrTimeout, http.StatusGatewayTimeout, "timeout", ExitFailure},
	} {
		t.Run(c.name, func(t *testing.T) {
			if k := Kind(c.err); k != c.kind {
				t.Errorf("Kind = %v, want %v", k, c.kind)
			}
			if s := HTTPStatus(c.err); s != c.status {
				t.Errorf("HTTPStatus = %d, want %d", s, c.status)
			}
			if c.err != nil {
				if code := Code(c.err); code != c.code {
					t.Errorf("Code = %q, want %q", code, c.code)
				}
			}
			if e := ExitCode(c.err); e != c.exit {
				t.Errorf("ExitCode = %d, want %d", e, c.exit)
			}
		})
	}
}

func TestErrorfKeepsMessageAndCause(t *testing.T) {
	err := Errorf(ErrConflict, "checkpoint %s is pending: %w", "c1", fs.ErrNotExist)
	if got, want := err.Error(), "checkpoint c1 is pending: file does not exist"; got != want {
		t.Errorf("message %q, want %q", got, want)
	}
	if !errors.Is(err, ErrConflict) || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("%v should be a conflict wrapping fs.ErrNotExist", err)
	}
	if errors.Is(err, ErrNotFound) {
		t.Errorf("%v is not a not-found", err)
	}
}

func TestFromHTTPStatusRoundTrips(t *testing.T) {
	for _, k := range kinds {
		if k.err == ErrExists {
			continue // 409 comes back as the wider conflict
		}
		if got := FromHTTPStatus(k.status); got != k.err {
			t.Errorf("FromHTTPStatus(%d) = %v, want %v", k.status, got, k.err)
		}
	}
	if FromHTTPStatus(http.StatusInternalServerError) != nil {
		t.Error("a 500 is of no kind")
	}
}
