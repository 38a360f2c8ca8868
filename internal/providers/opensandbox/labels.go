package opensandbox

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Sandbox labels are OpenSandbox metadata, which the server checks against
// Kubernetes label rules: a value is at most 63 characters of
// [A-Za-z0-9-_.], beginning and ending with a letter or digit. stasis
// labels may hold anything (test names hold slashes), so a value that
// breaks the rules, or holds '_', is sent encoded: "z", the value with
// every byte outside [A-Za-z0-9-.] (and a '-' or '.' at either end) written
// as "_" and two hex digits, then "z". A sent value holding '_' is always
// an encoded one; any other is the label's value itself. The encoding is
// deterministic, so listing by label sends the same value.

// expiryKey is the metadata entry holding stasis's absolute expiry, in
// unix milliseconds (rounded up). Its presence marks a stasis sandbox.
const expiryKey = "stasis.internal/expiry-ms"

func labelChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '.'
}

func alnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// plainValue: v may be sent as it is.
func plainValue(v string) bool {
	if v == "" {
		return true
	}
	if len(v) > 63 || !alnum(v[0]) || !alnum(v[len(v)-1]) {
		return false
	}
	for i := 0; i < len(v); i++ {
		if !labelChar(v[i]) {
			return false
		}
	}
	return true
}

func encodeValue(v string) (string, error) {
	if plainValue(v) {
		return v, nil
	}
	var b strings.Builder
	b.WriteByte('z')
	for i := 0; i < len(v); i++ {
		c := v[i]
		if labelChar(c) && (alnum(c) || i > 0 && i < len(v)-1) {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "_%02x", c)
		}
	}
	b.WriteByte('z')
	if b.Len() > 63 {
		return "", fmt.Errorf("the value %q is too long for OpenSandbox metadata (%d characters encoded; at most 63)", v, b.Len())
	}
	return b.String(), nil
}

func decodeValue(s string) string {
	if !strings.Contains(s, "_") || len(s) < 2 || s[0] != 'z' || s[len(s)-1] != 'z' {
		return s
	}
	body := s[1 : len(s)-1]
	var b strings.Builder
	for i := 0; i < len(body); i++ {
		if body[i] != '_' {
			b.WriteByte(body[i])
			continue
		}
		if i+3 > len(body) {
			return s
		}
		n, err := strconv.ParseUint(body[i+1:i+3], 16, 8)
		if err != nil {
			return s
		}
		b.WriteByte(byte(n))
		i += 2
	}
	return b.String()
}

// encodeLabels turns stasis labels into metadata, with the expiry entry
// when expiry is not zero.
func encodeLabels(labels map[string]string, expiry time.Time) (map[string]string, error) {
	md := make(map[string]string, len(labels)+1)
	for k, v := range labels {
		if k == expiryKey {
			return nil, fmt.Errorf("the label %s is stasis's own", k)
		}
		e, err := encodeValue(v)
		if err != nil {
			return nil, fmt.Errorf("label %s: %w", k, err)
		}
		md[k] = e
	}
	if !expiry.IsZero() {
		md[expiryKey] = expiryValue(expiry)
	}
	return md, nil
}

// decodeLabels turns metadata back into stasis labels and the expiry (zero
// when the sandbox has none of stasis's).
func decodeLabels(md map[string]string) (map[string]string, time.Time) {
	labels := map[string]string{}
	var expiry time.Time
	for k, v := range md {
		if k == expiryKey {
			if ms, err := strconv.ParseInt(v, 10, 64); err == nil {
				expiry = time.UnixMilli(ms).UTC()
			}
			continue
		}
		labels[k] = decodeValue(v)
	}
	return labels, expiry
}

// expiryValue is t in unix milliseconds, rounded up, so that the stored
// expiry is never before the one asked for.
func expiryValue(t time.Time) string {
	ms := t.UnixMilli()
	if t.After(time.UnixMilli(ms)) {
		ms++
	}
	return strconv.FormatInt(ms, 10)
}
