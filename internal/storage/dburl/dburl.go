// Package dburl owns what stasis reads from a database URL before it
// connects: whether it names PostgreSQL, and how to show it in a message
// without its password.
package dburl

import (
	"net/url"
	"strings"
)

// IsPostgres reports whether s names a PostgreSQL database (postgres://…
// or postgresql://…).
func IsPostgres(s string) bool {
	return strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://")
}

// Redact is the URL dsn with its password, in the user part or the query,
// replaced by xxxxx, for messages and logs.
func Redact(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return "(an unparsable URL)"
	}
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), "xxxxx")
	}
	q := u.Query()
	if q.Has("password") {
		q.Set("password", "xxxxx")
		u.RawQuery = q.Encode()
	}
	return u.String()
}
