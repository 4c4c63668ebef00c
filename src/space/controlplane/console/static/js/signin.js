import { api, session, ApiError } from "./api.js";
import { field, h, replace } from "./dom.js";

export function signInPage(main, done) {
  const error = h("p", { class: "error", role: "alert", id: "signin-error" });
  const key = h("input", { id: "api-key", name: "api-key", type: "password", autocomplete: "off",
                           spellcheck: "false", required: true, "aria-describedby": "key-help" });
  const project = h("input", { id: "project", name: "project", autocomplete: "off", placeholder: "default" });
  const submit = h("button", { type: "submit", class: "primary" }, "Sign in");
  const form = h("form", { class: "panel signin", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title" }, "Sign in to SPACE"),
    field("API key", key),
    h("p", { id: "key-help" },
      "The key stays in this browser tab (session storage) and is sent only to this server's API."),
    field("Project (organisation keys only)", project),
    submit, error);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    submit.disabled = true;
    error.textContent = "";
    session.save(key.value.trim(), project.value.trim());
    try {
      session.me = await api("GET", "/whoami");
      done();
    } catch (exc) {
      session.clear();
      error.textContent = exc instanceof ApiError && exc.status === 401
        ? "That key was not accepted (unknown or revoked)."
        : `Could not sign in: ${exc.message}`;
      key.focus();
    } finally {
      submit.disabled = false;
    }
  });
  replace(main, form);
  key.focus();
  return null;
}
