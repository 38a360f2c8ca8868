package ledger

// Fast paths for the JSON work of an append: canonicalising the request and
// response, and finding usage, tokens and the assistant message in a
// response. Each is a single pass over the bytes and gives exactly what the
// encoding/json code it stands in for gives (tests compare the two on
// generated and fuzzed input); whenever an input is unusual — a syntax error,
// a duplicate or case-folded key, a value of an unexpected type — the fast
// path reports so and the caller falls back to encoding/json, so errors and
// corner cases stay what they were.

import (
	"bytes"
	"strconv"
)

// maxDepth is encoding/json's nesting limit; deeper input is left to it.
const maxDepth = 10000

// canonSpecial marks the bytes a string scan must look at: the end of the
// string, escapes, control characters (invalid), the characters
// encoding/json escapes for HTML (<, >, &), and the first byte of U+2028
// and U+2029 (which it escapes too).
var canonSpecial = func() (t [256]bool) {
	for c := 0; c < 0x20; c++ {
		t[c] = true
	}
	for _, c := range []byte{'"', '\\', '<', '>', '&', 0xE2} {
		t[c] = true
	}
	return t
}()

const hexDigits = "0123456789abcdef"

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipSpace(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

// appendCanon appends src to dst as json.Marshal(json.RawMessage(src))
// writes it: validated, insignificant whitespace dropped, and <, >, &,
// U+2028 and U+2029 escaped. ok is false when src is not valid JSON (or
// nests deeper than encoding/json allows); dst is then unspecified and the
// caller asks encoding/json for its error.
func appendCanon(dst, src []byte) (out []byte, ok bool) {
	var stackBuf [64]byte
	stack := stackBuf[:0] // '{' or '[' per open container
	i, n := 0, len(src)
	for {
		// A value starts at i (after whitespace).
		i = skipSpace(src, i)
		if i >= n {
			return dst, false
		}
		switch c := src[i]; {
		case c == '{' || c == '[':
			if len(stack) >= maxDepth {
				return dst, false
			}
			dst = append(dst, c)
			i = skipSpace(src, i+1)
			if i < n && src[i] == c+2 { // '}' is '{'+2, ']' is '['+2
				dst = append(dst, c+2)
				i++
				break
			}
			stack = append(stack, c)
			if c == '{' {
				if dst, i, ok = appendCanonKey(dst, src, i); !ok {
					return dst, false
				}
			}
			continue
		case c == '"':
			if dst, i, ok = appendCanonString(dst, src, i); !ok {
				return dst, false
			}
		case c == 't':
			if !bytes.HasPrefix(src[i:], []byte("true")) {
				return dst, false
			}
			dst = append(dst, "true"...)
			i += 4
		case c == 'f':
			if !bytes.HasPrefix(src[i:], []byte("false")) {
				return dst, false
			}
			dst = append(dst, "false"...)
			i += 5
		case c == 'n':
			if !bytes.HasPrefix(src[i:], []byte("null")) {
				return dst, false
			}
			dst = append(dst, "null"...)
			i += 4
		default:
			e := scanNumber(src, i)
			if e < 0 {
				return dst, false
			}
			dst = append(dst, src[i:e]...)
			i = e
		}
		// After a value: a separator, the end of containers, or the end.
		for {
			i = skipSpace(src, i)
			if len(stack) == 0 {
				return dst, i == n
			}
			if i >= n {
				return dst, false
			}
			c, top := src[i], stack[len(stack)-1]
			if c == ',' {
				dst = append(dst, ',')
				i++
				if top == '{' {
					if dst, i, ok = appendCanonKey(dst, src, skipSpace(src, i)); !ok {
						return dst, false
					}
				}
				break
			}
			if c != top+2 {
				return dst, false
			}
			dst = append(dst, c)
			i++
			stack = stack[:len(stack)-1]
		}
	}
}

// appendCanonKey appends an object key and its colon; i is at the key's
// opening quote.
func appendCanonKey(dst, src []byte, i int) ([]byte, int, bool) {
	if i >= len(src) || src[i] != '"' {
		return dst, i, false
	}
	dst, i, ok := appendCanonString(dst, src, i)
	if !ok {
		return dst, i, false
	}
	i = skipSpace(src, i)
	if i >= len(src) || src[i] != ':' {
		return dst, i, false
	}
	return append(dst, ':'), i + 1, true
}

// appendCanonString appends the string starting at src[i] ('"') with
// encoding/json's HTML escaping, and returns the index after it.
func appendCanonString(dst, src []byte, i int) ([]byte, int, bool) {
	n := len(src)
	start := i
	j := i + 1
	for j < n {
		c := src[j]
		if !canonSpecial[c] {
			j++
			continue
		}
		switch {
		case c == '"':
			return append(dst, src[start:j+1]...), j + 1, true
		case c == '\\':
			if j+1 >= n {
				return dst, j, false
			}
			switch src[j+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				j += 2
			case 'u':
				if j+5 >= n || !isHex(src[j+2]) || !isHex(src[j+3]) || !isHex(src[j+4]) || !isHex(src[j+5]) {
					return dst, j, false
				}
				j += 6
			default:
				return dst, j, false
			}
		case c < 0x20:
			return dst, j, false
		case c == '<' || c == '>' || c == '&':
			dst = append(dst, src[start:j]...)
			dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			j++
			start = j
		default: // 0xE2: U+2028 and U+2029 are E2 80 A8 and E2 80 A9
			if j+2 < n && src[j+1] == 0x80 && src[j+2]&^1 == 0xA8 {
				dst = append(dst, src[start:j]...)
				dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[src[j+2]&0xF])
				j += 3
				start = j
			} else {
				j++
			}
		}
	}
	return dst, j, false
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// scanNumber returns the end of the JSON number at b[i], or -1.
func scanNumber(b []byte, i int) int {
	n := len(b)
	if i < n && b[i] == '-' {
		i++
	}
	switch {
	case i < n && b[i] == '0':
		i++
	case i < n && '1' <= b[i] && b[i] <= '9':
		for i < n && isDigit(b[i]) {
			i++
		}
	default:
		return -1
	}
	if i < n && b[i] == '.' {
		i++
		if i >= n || !isDigit(b[i]) {
			return -1
		}
		for i < n && isDigit(b[i]) {
			i++
		}
	}
	if i < n && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < n && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= n || !isDigit(b[i]) {
			return -1
		}
		for i < n && isDigit(b[i]) {
			i++
		}
	}
	return i
}

// The walkers below read JSON that is already known to be valid (the
// canonical form appendCanon wrote); they still stop with -1 rather than
// run off the end on anything else.

// skipString returns the index after the string starting at b[i] ('"').
func skipString(b []byte, i int) int {
	for j := i + 1; j < len(b); {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return -1
		}
		j += k
		// The quote ends the string unless an odd run of backslashes
		// escapes it (the opening quote stops the count).
		n := 0
		for b[j-1-n] == '\\' {
			n++
		}
		if n%2 == 0 {
			return j + 1
		}
		j++
	}
	return -1
}

// skipValue returns the index after the value starting at b[i].
func skipValue(b []byte, i int) int {
	i = skipSpace(b, i)
	if i >= len(b) {
		return -1
	}
	switch c := b[i]; c {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				if i = skipString(b, i); i < 0 {
					return -1
				}
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return -1
	default:
		j := i
		for j < len(b) {
			switch b[j] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return j
			}
			j++
		}
		return j
	}
}

// keyMatch says how an object key matches the field name a struct decoder
// would look it up by.
type keyMatch int

const (
	keyOther   keyMatch = iota // another key
	keyExact                   // the name itself
	keyUnusual                 // escaped, non-ASCII, or the name in other case: leave it to encoding/json
)

// matchKey compares a raw key (the bytes between its quotes) with name, as
// encoding/json's case-insensitive field lookup would, and calls anything
// it cannot be sure of unusual.
func matchKey(raw []byte, name string) keyMatch {
	if string(raw) == name {
		return keyExact
	}
	for _, c := range raw {
		if c == '\\' || c >= 0x80 {
			return keyUnusual // may unescape or case-fold to name
		}
	}
	if len(raw) == len(name) && bytes.EqualFold(raw, []byte(name)) {
		return keyUnusual
	}
	return keyOther
}

// members walks the object at b[i]: f is given each key's raw bytes and
// where its value starts, and returns where the value ends (-1 to stop the
// walk, which then fails). It returns the index after the object, or -1.
func members(b []byte, i int, f func(key []byte, from int) int) int {
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != '{' {
		return -1
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return i + 1
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return -1
		}
		ke := skipString(b, i)
		if ke < 0 {
			return -1
		}
		key := b[i+1 : ke-1]
		i = skipSpace(b, ke)
		if i >= len(b) || b[i] != ':' {
			return -1
		}
		to := f(key, skipSpace(b, i+1))
		if to < 0 {
			return -1
		}
		i = skipSpace(b, to)
		if i >= len(b) {
			return -1
		}
		if b[i] == '}' {
			return i + 1
		}
		if b[i] != ',' {
			return -1
		}
		i = skipSpace(b, i+1)
	}
}

// elements walks the array at b[i]: f is given where each element starts
// and returns where it ends (-1 to stop the walk, which then fails). It
// returns the index after the array, or -1.
func elements(b []byte, i int, f func(from int) int) int {
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != '[' {
		return -1
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == ']' {
		return i + 1
	}
	for {
		to := f(i)
		if to < 0 {
			return -1
		}
		i = skipSpace(b, to)
		if i >= len(b) {
			return -1
		}
		if b[i] == ']' {
			return i + 1
		}
		if b[i] != ',' {
			return -1
		}
		i = skipSpace(b, i+1)
	}
}

// parseIDs decodes the list of token ids at b[i] as json.Unmarshal into
// []int64 would, for the usual case: an array of integers, or null (nil).
// It returns where the value ends; ok is false for anything else.
func parseIDs(b []byte, i int) (ids []int64, to int, ok bool) {
	if bytes.HasPrefix(b[i:], []byte("null")) {
		return nil, i + 4, true
	}
	ids = make([]int64, 0, 64)
	to = elements(b, i, func(from int) int {
		e := from
		for e < len(b) && (isDigit(b[e]) || b[e] == '-') {
			e++
		}
		v, ok := parseInt(b[from:e])
		if !ok {
			return -1
		}
		ids = append(ids, v)
		return e
	})
	return ids, to, to >= 0
}

// parseInt parses a JSON integer that fits int64 (no fraction, no
// exponent); ok is false otherwise.
func parseInt(b []byte) (int64, bool) {
	neg := len(b) > 0 && b[0] == '-'
	if neg {
		b = b[1:]
	}
	if len(b) == 0 || len(b) > 19 {
		return 0, false
	}
	var u uint64
	for _, c := range b {
		if !isDigit(c) {
			return 0, false
		}
		u = u*10 + uint64(c-'0')
	}
	if neg {
		if u > 1<<63 {
			return 0, false
		}
		return -int64(u), true
	}
	if u > 1<<63-1 {
		return 0, false
	}
	return int64(u), true
}

// parseFloat parses the JSON number b as a float64 as encoding/json would;
// ok is false for anything else (a string, an out-of-range number).
func parseFloat(b []byte) (float64, bool) {
	if f, ok := parseShortDecimal(b); ok {
		return f, true
	}
	if len(b) == 0 || (b[0] != '-' && !isDigit(b[0])) {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(b), 64)
	return f, err == nil
}

// pow10 are the powers of ten a float64 holds exactly.
var pow10 = [...]float64{1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10,
	1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22}

// parseShortDecimal parses a number without an exponent whose digits, read
// as an integer, are at most 2^53, with at most 22 of them after the point
// (a logprob such as -0.338788): that integer and the power of ten are
// exact float64s, so their quotient is the correctly rounded value, which
// is what strconv.ParseFloat returns (Clinger's fast path). ok is false for
// any other number, which strconv then parses.
func parseShortDecimal(b []byte) (float64, bool) {
	i, n := 0, len(b)
	neg := n > 0 && b[0] == '-'
	if neg {
		i++
	}
	var m uint64
	digits, frac := 0, -1 // frac: digits after the point, -1 before it
	for ; i < n; i++ {
		c := b[i]
		switch {
		case isDigit(c):
			if digits++; digits > 19 {
				return 0, false
			}
			m = m*10 + uint64(c-'0')
			if frac >= 0 {
				frac++
			}
		case c == '.' && frac < 0 && digits > 0:
			frac = 0
		default:
			return 0, false // an exponent, or not a number
		}
	}
	if digits == 0 || frac == 0 || m > 1<<53 || frac > 22 {
		return 0, false
	}
	f := float64(m)
	if frac > 0 {
		f /= pow10[frac]
	}
	if neg {
		f = -f
	}
	return f, true
}
