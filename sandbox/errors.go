package sandbox

import (
	"errors"
	"fmt"
	"net/http"
)

// The kinds of error a provider returns. Match them with errors.Is.
var (
	ErrNotFound    = errors.New("not found")
	ErrExpired     = errors.New("expired")
	ErrWrongState  = errors.New("wrong state")
	ErrUnsupported = errors.New("unsupported")
	ErrInvalid     = errors.New("invalid")
	ErrTimeout     = errors.New("timed out")
)

// Error is a provider error of one kind about one thing.
type Error struct {
	Kind error  // one of the Err* values
	Op   string // "exec", "fork", ...
	What string // "sandbox sb-…", "snapshot snap-…"
	Msg  string // what went wrong and what to do
}

func (e *Error) Error() string {
	s := e.Op
	if e.What != "" {
		s += " " + e.What
	}
	s += ": " + e.Kind.Error()
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

// Is makes errors.Is(err, ErrNotFound) and friends work.
func (e *Error) Is(target error) bool { return target == e.Kind }

// Errorf makes an Error.
func Errorf(kind error, op, what, format string, args ...any) error {
	return &Error{Kind: kind, Op: op, What: what, Msg: fmt.Sprintf(format, args...)}
}

// HTTPStatus maps an error to the status code an HTTP API answers with.
func HTTPStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrExpired):
		return http.StatusGone
	case errors.Is(err, ErrWrongState):
		return http.StatusConflict
	case errors.Is(err, ErrUnsupported):
		return http.StatusNotImplemented
	case errors.Is(err, ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, ErrTimeout):
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// ExitCode maps an error to a CLI exit code: 2 for what the user can fix in
// the request (invalid, unsupported), 3 for a missing or expired thing, 1
// otherwise.
func ExitCode(err error) int {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, ErrInvalid), errors.Is(err, ErrUnsupported):
		return 2
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrExpired):
		return 3
	}
	return 1
}
