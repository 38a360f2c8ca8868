package retryafter

import (
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"", 0, false},
		{"  ", 0, false},
		{"0", 0, true},
		{"7", 7 * time.Second, true},
		{" 120 ", 2 * time.Minute, true},
		{"-1", 0, false},
		{"soon", 0, false},
		{"1.5", 0, false},
		{"Sun, 06 Dec 2026 12:00:30 GMT", 30 * time.Second, true},
		{"Sun, 06 Dec 2026 11:00:00 GMT", 0, true}, // past: no wait
		{"Sunday, 06-Dec-26 12:01:00 GMT", time.Minute, true},
	} {
		d, ok := Parse(c.in, now)
		if d != c.want || ok != c.ok {
			t.Errorf("Parse(%q) = %v, %v; want %v, %v", c.in, d, ok, c.want, c.ok)
		}
	}
}
