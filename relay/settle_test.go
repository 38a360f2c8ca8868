package relay

import (
	"strconv"
	"strings"
	"testing"
)

func TestParseSettlements(t *testing.T) {
	s := []settlement{{seq: 3, n: 7, disp: dispDelivered}, {seq: 4, n: 9, disp: dispAbandoned}}
	got, err := ParseSettlements("ep", formatSettlements(s))
	if err != nil || len(got) != 2 || got[0].Seq != 3 || got[0].CallID != "ep/7" || got[0].Disposition != "delivered" ||
		got[1].Seq != 4 || got[1].CallID != "ep/9" || got[1].Disposition != "abandoned" {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if got, err := ParseSettlements("ep", "5.0.a"); err != nil || len(got) != 1 || got[0].CallID != "" || got[0].Seq != 5 {
		t.Fatalf("an answer no call read: %+v %v", got, err)
	}
	if got, err := ParseSettlements("ep", ""); err != nil || got != nil {
		t.Fatalf("empty: %+v %v", got, err)
	}
	for _, bad := range []string{"3.7", "3.7.x", "0.7.d", "3.0.d", "-1.2.d", "3.7.d,", "a.b.d", "3.7.d.1", "99999999999999999999.1.d",
		strings.Repeat("1.1.d,", maxSettlements) + "1.1.d"} {
		if _, err := ParseSettlements("ep", bad); err == nil {
			t.Errorf("%.40q parsed", bad)
		}
	}
}

// FuzzParseSettlements: any header either fails with an error or parses
// into settlements that format back to an equivalent header.
func FuzzParseSettlements(f *testing.F) {
	for _, s := range []string{"1.1.d", "3.7.d,4.9.a", " 2.2.a", "3.7", "x", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, h string) {
		got, err := ParseSettlements("ep", h)
		if err != nil {
			return
		}
		var back []settlement
		for _, s := range got {
			var n int64
			if s.CallID != "" { // "": an answer no call read (N 0)
				n, err = strconv.ParseInt(strings.TrimPrefix(s.CallID, "ep/"), 10, 64)
				if err != nil || n < 1 {
					t.Fatalf("%q parsed into %+v", h, s)
				}
			} else if s.Disposition != "abandoned" {
				t.Fatalf("%q: an unknown call settled %q", h, s.Disposition)
			}
			if s.Seq < 1 {
				t.Fatalf("%q parsed into %+v", h, s)
			}
			d := dispDelivered
			if s.Disposition == "abandoned" {
				d = dispAbandoned
			} else if s.Disposition != "delivered" {
				t.Fatalf("%q: disposition %q", h, s.Disposition)
			}
			back = append(back, settlement{seq: s.Seq, n: n, disp: d})
		}
		again, err := ParseSettlements("ep", formatSettlements(back))
		if err != nil || len(again) != len(got) {
			t.Fatalf("%q: formatted back: %+v %v", h, again, err)
		}
		for i := range got {
			if again[i] != got[i] {
				t.Fatalf("%q: %+v became %+v", h, got[i], again[i])
			}
		}
	})
}
