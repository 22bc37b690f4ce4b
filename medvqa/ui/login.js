// The login page's own script. Gradio's login form says "Incorrect credentials" when a try is answered 400
// and reloads on 200, but shows nothing for any other answer: a try the login throttle refuses (429, "please
// wait N s", access.py) or a form too large (413) would leave the form as it was, without a word. This
// script, which access.AccessGuard adds to the login page only, watches the page's own calls to the login
// route and shows such an answer's message above the form, counting the wait down from its Retry-After.
() => {
  const fetched = window.fetch.bind(window);
  let timer = null;
  const say = (text) => {
    let note = document.getElementById("medvqa-login-note");
    if (text === null) {
      note?.remove();
      return;
    }
    if (!note) {
      const form = document.querySelector("input[type=password]")?.closest(".form");
      if (!form) return;
      note = document.createElement("p");
      note.id = "medvqa-login-note";
      note.setAttribute("role", "alert");
      note.style.cssText = "border-left: 4px solid #b91c1c; padding: 4px 8px; margin: 8px 0;";
      form.before(note);
    }
    note.textContent = text;
  };
  const countDown = (message, seconds) => {
    clearInterval(timer);
    const until = Date.now() + seconds * 1000;
    const tell = () => {
      const left = Math.ceil((until - Date.now()) / 1000);
      if (left <= 0) {
        clearInterval(timer);
        say("You can try to log in again now.");
      } else {
        say(message.replace(/please wait \d+ s/, `please wait ${left} s`));
      }
    };
    tell();
    timer = setInterval(tell, 1000);
  };
  window.fetch = async (resource, init) => {
    const response = await fetched(resource, init);
    let path = "";
    try {
      path = new URL(resource instanceof Request ? resource.url : String(resource), location.href).pathname;
    } catch (error) {
      return response;
    }
    if (!/\/login\/?$/.test(path)) return response;
    clearInterval(timer);
    if (response.status === 200 || response.status === 400) {
      say(null);  // Gradio's own form says what these mean
      return response;
    }
    let message = `The login could not be checked (HTTP ${response.status}): please try again.`;
    try {
      const detail = (await response.clone().json()).detail;
      if (typeof detail === "string" && detail) message = detail;
    } catch (error) {
      // not JSON: the general message stands
    }
    const wait = Number(response.headers.get("retry-after"));
    if (response.status === 429 && wait > 0) countDown(message, wait);
    else say(message);
    return response;
  };
}
