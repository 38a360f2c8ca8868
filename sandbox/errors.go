package sandbox

import (
	"fmt"
)

// Error is a provider error of one kind about one thing. Its kind is one of
// package errdefs's (ErrNotFound, ErrExpired, ErrConflict, ErrUnsupported,
// ErrInvalid, ErrTimeout, ErrUnavailable), which give it its HTTP status
// and exit code; match it with errors.Is.
type Error struct {
	Kind error  // one of errdefs's Err* values
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

// Is makes errors.Is(err, errdefs.ErrNotFound) and friends work.
func (e *Error) Is(target error) bool { return target == e.Kind }

// Errorf makes an Error.
func Errorf(kind error, op, what, format string, args ...any) error {
	return &Error{Kind: kind, Op: op, What: what, Msg: fmt.Sprintf(format, args...)}
}
