// Package errdefs owns stasis's one error vocabulary: the kinds of failure
// every layer reports (not found, exists, conflict, invalid, unsupported,
// expired, timeout, unavailable), and the one mapping from a kind to an
// HTTP status, an API error type and a CLI exit code.
//
// A package returns an error that matches one kind with errors.Is, by
// wrapping it (fmt.Errorf("checkpoint %q: %w", id, errdefs.ErrNotFound)),
// with Errorf, or with a type of its own whose Is method names the kind
// (sandbox.Error does). The server and the CLI never classify an error by
// its text: they ask Kind. A provider written outside this tree returns
// these same values, so its errors get the same statuses and exit codes.
package errdefs

import (
	"errors"
	"fmt"
	"net/http"
)

// The kinds. Match them with errors.Is (or the Is* functions).
var (
	// ErrNotFound: the thing named does not exist (or no longer does).
	ErrNotFound = errors.New("not found")
	// ErrExists: the thing to create exists already (ids are not reused).
	ErrExists = errors.New("already exists")
	// ErrConflict: the request is well formed, but the present state of
	// the thing forbids it (a paused sandbox asked to pause, a restore of
	// a pending checkpoint, a verify before the harness ended). Nothing
	// was changed.
	ErrConflict = errors.New("wrong state")
	// ErrInvalid: the request itself is wrong (a bad argument, a
	// malformed body, a path out of the sandbox). Nothing was changed.
	ErrInvalid = errors.New("invalid")
	// ErrUnsupported: well formed, but this provider or build cannot do it.
	ErrUnsupported = errors.New("unsupported")
	// ErrExpired: the thing existed but its time ran out (a sandbox past
	// its expiry).
	ErrExpired = errors.New("expired")
	// ErrTimeout: the operation did not finish within its deadline; it
	// may have taken effect.
	ErrTimeout = errors.New("timed out")
	// ErrUnavailable: a service the operation needs cannot be reached or
	// is shutting down; trying again later may work.
	ErrUnavailable = errors.New("unavailable")
)

// kind is one kind with its API error type, HTTP status and exit code.
type kind struct {
	err    error
	code   string
	status int
	exit   int
}

var kinds = []kind{
	{ErrInvalid, "invalid_request", http.StatusBadRequest, ExitRefused},
	{ErrUnsupported, "unsupported", http.StatusNotImplemented, ExitRefused},
	{ErrNotFound, "not_found", http.StatusNotFound, ExitMissing},
	{ErrExpired, "expired", http.StatusGone, ExitMissing},
	{ErrExists, "conflict", http.StatusConflict, ExitRefused},
	{ErrConflict, "conflict", http.StatusConflict, ExitRefused},
	{ErrTimeout, "timeout", http.StatusGatewayTimeout, ExitFailure},
	{ErrUnavailable, "unavailable", http.StatusServiceUnavailable, ExitFailure},
}

// The CLI's exit codes.
const (
	// ExitFailure: the operation failed (a timeout, an unavailable
	// service, or an error of no kind).
	ExitFailure = 1
	// ExitRefused: the request was refused and nothing changed: it is
	// wrong or unsupported, or the present state forbids it.
	ExitRefused = 2
	// ExitMissing: the thing named does not exist or has expired.
	ExitMissing = 3
)

// CodeInternal is the API error type of an error of no kind.
const CodeInternal = "internal"

// kindOf finds err's kind: the outermost error in its chain that is, or
// says (by an Is method) it is, one of the kinds. So a refusal that wraps
// its cause's not-found stays a conflict.
func kindOf(err error) *kind {
	if err == nil {
		return nil
	}
	for i := range kinds {
		if err == kinds[i].err {
			return &kinds[i]
		}
	}
	if x, ok := err.(interface{ Is(error) bool }); ok {
		for i := range kinds {
			if x.Is(kinds[i].err) {
				return &kinds[i]
			}
		}
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return kindOf(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if k := kindOf(e); k != nil {
				return k
			}
		}
	}
	return nil
}

// Kind returns the kind err is (one of the Err* values), or nil if it is
// of none: an internal error.
func Kind(err error) error {
	if k := kindOf(err); k != nil {
		return k.err
	}
	return nil
}

// HTTPStatus is the status an HTTP API answers err with: 200 for nil, 500
// for an error of no kind.
func HTTPStatus(err error) int {
	if err == nil {
		return http.StatusOK
	}
	if k := kindOf(err); k != nil {
		return k.status
	}
	return http.StatusInternalServerError
}

// Code is the error type an HTTP API names err by in its body
// ("not_found", "conflict", ...; CodeInternal for an error of no kind).
func Code(err error) string {
	if k := kindOf(err); k != nil {
		return k.code
	}
	return CodeInternal
}

// ExitCode is the CLI's exit code for err: 0 for nil, ExitRefused for a
// request refused with nothing changed (invalid, unsupported, exists,
// conflict), ExitMissing for a missing or expired thing, ExitFailure
// otherwise.
func ExitCode(err error) int {
	if err == nil {
		return 0
	}
	if k := kindOf(err); k != nil {
		return k.exit
	}
	return ExitFailure
}

// FromHTTPStatus is the kind a peer's HTTP status names (nil for a status
// of no kind), for clients of stasis's and hosted services' APIs.
func FromHTTPStatus(status int) error {
	switch status {
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		return ErrInvalid
	case http.StatusNotFound:
		return ErrNotFound
	case http.StatusConflict:
		return ErrConflict
	case http.StatusGone:
		return ErrExpired
	case http.StatusNotImplemented:
		return ErrUnsupported
	case http.StatusGatewayTimeout, http.StatusRequestTimeout:
		return ErrTimeout
	case http.StatusServiceUnavailable, http.StatusTooManyRequests, http.StatusBadGateway:
		return ErrUnavailable
	}
	return nil
}

// kindError is an error of one kind whose message is its own text (not
// the kind's), wrapping what its format wrapped.
type kindError struct {
	kind error
	err  error
}

func (e *kindError) Error() string        { return e.err.Error() }
func (e *kindError) Is(target error) bool { return target == e.kind }
func (e *kindError) Unwrap() error        { return e.err }

// Errorf makes an error of kind whose message is the formatted text alone;
// %w in format wraps as fmt.Errorf does.
func Errorf(kind error, format string, args ...any) error {
	return &kindError{kind, fmt.Errorf(format, args...)}
}

// IsNotFound reports whether err is of kind ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// IsConflict reports whether err is of kind ErrConflict or ErrExists.
func IsConflict(err error) bool { return errors.Is(err, ErrConflict) || errors.Is(err, ErrExists) }
