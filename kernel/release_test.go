package kernel

import "testing"

func TestResendsOnNewSocket(t *testing.T) {
	for rel, want := range map[string]bool{
		"6.1.0-28-amd64":           true,
		"5.7.0":                    true,
		"5.10.0-33-cloud-amd64":    true,
		"5.6.19":                   false,
		"5.4.0-216-generic":        false,
		"4.18.0-553.el8_10.x86_64": false,
		"6":                        false,
		"unknown":                  false,
		"":                         false,
		"10.2":                     true,
	} {
		if got := ResendsOnNewSocket(rel); got != want {
			t.Errorf("%q: got %v, want %v", rel, got, want)
		}
	}
	if Release() == "" {
		t.Error("empty release")
	}
}
